"""Run RLinf 0.3.0's real LiberoEnv (libero_10, 2 envs, no Ray, no GPU) and record what it does.

Run it with the RLinf venv's python (scripts/rlinf_env.sh prints its path), never from pytest:

    PY="$(scripts/rlinf_env.sh | tail -n 1)"
    "$PY" tests/real_rlinf/libero_runner.py --steps 16 --seed 0 --out /tmp/a.json
    "$PY" tests/real_rlinf/libero_runner.py --steps 16 --seed 0 --patched --out /tmp/b.json
    "$PY" tests/real_rlinf/libero_runner.py --steps 16 --patched --out /tmp/c.json \\
        --reward-model '{"enable": true, "endpoint": "http://127.0.0.1:18080/score"}'

It builds `rlinf.envs.libero.libero_env.LiberoEnv(cfg, num_envs=2, seed_offset=0,
total_num_processes=1, worker_info=None)` from a config made here, resets it, runs `--steps`
steps through `chunk_step` (chunks of `--chunk`, as RLinf's EnvWorker does) or `step`, and
writes per-step rewards, terminations, truncations, `infos["episode"]`, frame digests and
timings as JSON (or .npz with every main_images frame). The last stdout line is a JSON
summary. The simulators run in spawned subprocesses, hence the `__main__` guard.

`--patched` applies integrations/rlinf/libero_env.patch to a COPY of the installed
libero_env.py (in a temp dir; site-packages is never touched) and registers that copy as
`rlinf.envs.libero.libero_env` before anything imports the original. The patch tool's own
output (offsets, fuzz) is in the result under "patch".

Config: RLinf v0.3 (tag v0.3 = commit 0505431899574619da86f551bad70b71e0ea2177, 2026-07-15,
the source of the PyPI wheel rlinf==0.3.0; the examples/ configs are not in the wheel):

    examples/embodiment/config/env/libero_10.yaml          (env.train base, "env/libero_10@env.train")
        env_type: libero, task_suite_name: libero_10, auto_reset: False,
        ignore_terminations: False, use_fixed_reset_state_ids: True,
        use_rel_reward: True, reward_coef: 5.0, is_eval: False, seed: 0, group_size: 1,
        video_cfg: {save_video: True, info_on_video: True, video_base_dir: ...},
        init_params: {camera_heights: 256, camera_widths: 256}
    examples/embodiment/config/libero_10_grpo_openvlaoft.yaml   (its env.train overrides)
        rollout_epoch: 16, total_num_envs: 64, max_steps_per_rollout_epoch: 512,
        max_episode_steps: 512, use_fixed_reset_state_ids: True,
        use_ordered_reset_state_ids: True  (base: False), reset_gripper_open: False (base: True)
    examples/embodiment/config/model/openvla_oft.yaml   (actor.model in that run)
        num_action_chunks: 8 (-> --chunk default), action_dim: 7 (-> the action width)

Changed here for a short CPU run: total_num_envs 2 (= num_envs), max_episode_steps
(--max-episode-steps, default --steps, so every episode truncates on the last step),
max_steps_per_rollout_epoch = --steps, seed (--seed), video_cfg.save_video False and
video_base_dir a temp dir (LiberoEnv only stores video_cfg; RLinf's RecordVideo wrapper is
not used here), and --ignore-terminations / --reward-coef / --use-rel-reward / --group-size
when given. `reward_model` (--reward-model JSON) is this project's block (rlinf_client.hook).
The config is an OmegaConf DictConfig in struct mode, as Hydra hands `cfg.env.train` over.

Actions are deterministic: `zeros`, or `random` (default): uniform in [-scale, scale] for the
6 arm dims and a gripper command of +-1, from numpy's default_rng(--seed).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PATCH = REPO / "integrations" / "rlinf" / "libero_env.patch"
MODULE = "rlinf.envs.libero.libero_env"
RLINF_V03_COMMIT = "0505431899574619da86f551bad70b71e0ea2177"

# examples/embodiment/config/env/libero_10.yaml at RLinf v0.3
LIBERO_10_YAML: dict[str, Any] = {
    "env_type": "libero",
    "task_suite_name": "libero_10",
    "total_num_envs": None,
    "auto_reset": False,
    "ignore_terminations": False,
    "max_steps_per_rollout_epoch": 512,
    "max_episode_steps": 512,
    "use_fixed_reset_state_ids": True,
    "use_ordered_reset_state_ids": False,
    "use_rel_reward": True,
    "reward_coef": 5.0,
    "reset_gripper_open": True,
    "is_eval": False,
    "seed": 0,
    "group_size": 1,
    "video_cfg": {
        "save_video": True,
        "info_on_video": True,
        "video_base_dir": "${runner.logger.log_path}/video/train",
    },
    "init_params": {"camera_heights": 256, "camera_widths": 256},
}
# env.train in examples/embodiment/config/libero_10_grpo_openvlaoft.yaml at RLinf v0.3
GRPO_TRAIN_OVERRIDES: dict[str, Any] = {
    "rollout_epoch": 16,
    "total_num_envs": 64,
    "max_steps_per_rollout_epoch": 512,
    "max_episode_steps": 512,
    "use_fixed_reset_state_ids": True,
    "use_ordered_reset_state_ids": True,
    "reset_gripper_open": False,
}
NUM_ACTION_CHUNKS = 8  # model/openvla_oft.yaml
ACTION_DIM = 7  # model/openvla_oft.yaml


def _bool_arg(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16, help="env steps after reset (16-24 is plenty)")
    p.add_argument("--max-episode-steps", type=int, default=None,
                   help="truncation step (default: --steps, so every episode truncates in the run)")
    p.add_argument("--chunk", type=int, default=NUM_ACTION_CHUNKS,
                   help="steps per chunk_step call (OpenVLA-OFT: 8); 0 = call step() per step")
    p.add_argument("--num-envs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="cfg.seed and the action generator's seed")
    p.add_argument("--group-size", type=int, default=None, help="cfg.group_size (run default: 1)")
    p.add_argument("--actions", choices=("random", "zeros"), default="random")
    p.add_argument("--action-scale", type=float, default=0.5)
    p.add_argument("--ignore-terminations", action="store_true")
    p.add_argument("--reward-coef", type=float, default=None, help="run default: 5.0")
    p.add_argument("--use-rel-reward", type=_bool_arg, default=None, help="true/false; run default: true")
    p.add_argument("--auto-reset", type=_bool_arg, default=None, help="true/false; run default: false")
    p.add_argument("--patched", action="store_true",
                   help="apply the repo's libero_env.patch to a temp copy and use that module")
    p.add_argument("--patch-file", type=Path, default=DEFAULT_PATCH)
    p.add_argument("--reward-model", type=json.loads, default=None,
                   help="JSON for the env's reward_model block, e.g. '{\"enable\": true, ...}'")
    p.add_argument("--out", type=Path, default=None,
                   help="result file: .json (frame sha256 + the reset and last frames as base64 .npy) "
                        "or .npz (every main_images frame, plus the JSON as 'result_json')")
    p.add_argument("--print-config", action="store_true", help="print the env config and exit")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.max_episode_steps is None:
        args.max_episode_steps = args.steps
    if args.chunk < 0:
        p.error("--chunk must be >= 0")
    return args


def build_cfg_dict(args: argparse.Namespace, video_dir: str) -> dict[str, Any]:
    cfg = json.loads(json.dumps(LIBERO_10_YAML))
    cfg.update(json.loads(json.dumps(GRPO_TRAIN_OVERRIDES)))
    cfg["total_num_envs"] = args.num_envs
    cfg["max_episode_steps"] = args.max_episode_steps
    cfg["max_steps_per_rollout_epoch"] = args.steps
    cfg["seed"] = args.seed
    cfg["video_cfg"]["save_video"] = False
    cfg["video_cfg"]["video_base_dir"] = video_dir
    if args.group_size is not None:
        cfg["group_size"] = args.group_size
    if args.ignore_terminations:
        cfg["ignore_terminations"] = True
    if args.reward_coef is not None:
        cfg["reward_coef"] = args.reward_coef
    if args.use_rel_reward is not None:
        cfg["use_rel_reward"] = args.use_rel_reward
    if args.auto_reset is not None:
        cfg["auto_reset"] = args.auto_reset
    if args.reward_model is not None:
        cfg["reward_model"] = args.reward_model
    return cfg


def apply_patch_to_copy(patch_file: Path, workdir: Path) -> tuple[Path, dict[str, Any]]:
    """Copy the installed libero_env.py to workdir/rlinf/envs/libero/ and patch the copy."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or spec.origin is None:
        raise SystemExit(f"{MODULE} is not installed in {sys.prefix}")
    rel = Path("rlinf/envs/libero/libero_env.py")
    target = workdir / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(spec.origin, target)
    info: dict[str, Any] = {"file": str(patch_file), "original": spec.origin,
                            "sha256_patch": hashlib.sha256(patch_file.read_bytes()).hexdigest()}
    # git apply --check first (strict, no fuzz): informative only.
    if shutil.which("git"):
        check = subprocess.run(["git", "apply", "--check", "-v", str(patch_file)], cwd=workdir,
                               capture_output=True, text=True)
        info["git_apply_check"] = {"rc": check.returncode, "output": (check.stdout + check.stderr).strip()}
    done = subprocess.run(["patch", "-p1", "--forward", "--no-backup-if-mismatch", "-i", str(patch_file)],
                          cwd=workdir, capture_output=True, text=True)
    info["patch"] = {"rc": done.returncode, "output": (done.stdout + done.stderr).strip()}
    if done.returncode != 0:
        raise SystemExit(f"the patch does not apply to {spec.origin}:\n{done.stdout}{done.stderr}")
    return target, info


def load_as_module(path: Path) -> Any:
    """Import `path` under the installed module's name, before anything imports the original."""
    if MODULE in sys.modules:
        raise RuntimeError(f"{MODULE} was imported before the patched copy could replace it")
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(MODULE, None)
        raise
    import rlinf.envs.libero as package  # keep attribute access consistent with sys.modules
    package.libero_env = module
    return module


def _np(value: Any) -> Any:
    import numpy as np

    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _jsonable(value: Any) -> Any:
    import numpy as np

    if hasattr(value, "detach") or isinstance(value, np.ndarray | np.generic):
        return _np(value).tolist()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _describe(value: Any) -> dict[str, Any]:
    kind = type(value).__module__ + "." + type(value).__qualname__
    if hasattr(value, "shape"):
        return {"type": kind, "dtype": str(value.dtype), "shape": list(value.shape)}
    if isinstance(value, list):
        return {"type": kind, "len": len(value), "item_type": type(value[0]).__name__ if value else None}
    return {"type": kind}


def _npy_b64(array: Any) -> str:
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def make_actions(args: argparse.Namespace) -> Any:
    import numpy as np

    shape = (args.num_envs, args.steps, ACTION_DIM)
    if args.actions == "zeros":
        return np.zeros(shape, dtype=np.float32)
    rng = np.random.default_rng(args.seed)
    actions = rng.uniform(-args.action_scale, args.action_scale, size=shape).astype(np.float32)
    actions[..., -1] = np.where(rng.random(shape[:2]) < 0.5, -1.0, 1.0)
    return actions


class Recorder:
    """Everything the env hands back, one entry per env step (reset = entry 0 of frames)."""

    def __init__(self) -> None:
        self.frames: list[Any] = []  # main_images per observation, N×H×W×3
        self.frame_sha: list[list[str]] = []
        self.wrist_sha: list[list[str]] = []
        self.states: list[Any] = []
        self.task_descriptions: list[list[str]] = []
        self.rewards: list[Any] = []
        self.terminations: list[Any] = []
        self.truncations: list[Any] = []
        self.episode: list[dict[str, Any]] = []
        self.info_keys: list[list[str]] = []
        self.step_seconds: list[float] = []
        self.types: dict[str, Any] = {}

    def observe(self, obs: dict[str, Any]) -> None:
        import numpy as np

        if "obs" not in self.types:
            self.types["obs"] = {k: _describe(v) for k, v in obs.items()}
        images = _np(obs["main_images"])
        self.frames.append(np.array(images, copy=True))
        self.frame_sha.append([hashlib.sha256(np.ascontiguousarray(f).tobytes()).hexdigest()
                               for f in images])
        if "wrist_images" in obs:
            self.wrist_sha.append([hashlib.sha256(np.ascontiguousarray(f).tobytes()).hexdigest()
                                   for f in _np(obs["wrist_images"])])
        if "states" in obs:
            self.states.append(_np(obs["states"]).tolist())
        self.task_descriptions.append([str(t) for t in obs.get("task_descriptions", [])])

    def step(self, out: tuple, seconds: float) -> None:
        obs, reward, terminations, truncations, infos = out
        if "step" not in self.types:
            self.types["step"] = {"reward": _describe(reward), "terminations": _describe(terminations),
                                  "truncations": _describe(truncations)}
            self.types["infos_episode"] = {k: _describe(v) for k, v in infos.get("episode", {}).items()}
        self.observe(obs)
        self.rewards.append(_np(reward).tolist())
        self.terminations.append(_np(terminations).tolist())
        self.truncations.append(_np(truncations).tolist())
        self.episode.append(_jsonable(infos.get("episode", {})))
        self.info_keys.append(sorted(infos))
        self.step_seconds.append(seconds)


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("MUJOCO_GL", "egl")
    # LIBERO writes absolute paths into $LIBERO_CONFIG_PATH/config.yaml on first import; the
    # venv from scripts/rlinf_env.sh sets a per-venv value (a .pth file), this is the fallback.
    os.environ.setdefault("LIBERO_CONFIG_PATH", os.path.join(sys.prefix, "libero-config"))

    workdir = Path(tempfile.mkdtemp(prefix="libero-runner-"))
    result: dict[str, Any] = {
        "rlinf_commit_of_configs": RLINF_V03_COMMIT,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "env": {k: os.environ.get(k) for k in ("MUJOCO_GL", "LIBERO_CONFIG_PATH", "PYOPENGL_PLATFORM")},
        "python": sys.executable,
    }
    try:
        patched_path = None
        if args.patched:
            patched_path, result["patch"] = apply_patch_to_copy(args.patch_file.resolve(), workdir)

        t0 = time.perf_counter()
        import numpy as np
        from omegaconf import OmegaConf

        if patched_path is not None:
            module = load_as_module(patched_path)
        else:
            import importlib

            module = importlib.import_module(MODULE)
        LiberoEnv = module.LiberoEnv
        import_s = time.perf_counter() - t0
        result["module_file"] = module.__file__

        cfg_dict = build_cfg_dict(args, str(workdir / "video"))
        result["config"] = cfg_dict
        if args.print_config:
            return result
        cfg = OmegaConf.create(cfg_dict)
        OmegaConf.set_struct(cfg, True)  # as Hydra composes it

        import rlinf

        versions = {"rlinf": getattr(rlinf, "__version__", None)}
        from importlib import metadata

        for dist in ("rlinf", "rlinf-libero", "robosuite", "mujoco", "torch", "numpy", "gym",
                     "vlm-reward-proxy"):
            try:
                versions[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                versions[dist] = None
        if args.reward_model and args.reward_model.get("enable"):
            import rlinf_client

            versions["rlinf_client_file"] = rlinf_client.__file__
        result["versions"] = versions

        rec = Recorder()
        t0 = time.perf_counter()
        env = LiberoEnv(cfg, num_envs=args.num_envs, seed_offset=0, total_num_processes=1,
                        worker_info=None)
        init_s = time.perf_counter() - t0
        try:
            inner_step = env.step

            def timed_step(actions=None, auto_reset=True):
                start = time.perf_counter()
                out = inner_step(actions, auto_reset=auto_reset)
                rec.step(out, time.perf_counter() - start)
                return out

            env.step = timed_step  # chunk_step calls self.step: every step is recorded

            t0 = time.perf_counter()
            obs, reset_infos = env.reset()
            reset_s = time.perf_counter() - t0
            rec.observe(obs)
            result["reset_info_keys"] = sorted(reset_infos)
            result["reset_state_ids"] = _np(env.reset_state_ids).tolist()
            result["task_ids"] = _np(env.task_ids).tolist()
            result["trial_ids"] = _np(env.trial_ids).tolist()

            actions = make_actions(args)
            chunks: list[dict[str, Any]] = []
            chunk_seconds: list[float] = []
            if args.chunk:
                for start in range(0, args.steps, args.chunk):
                    part = actions[:, start:start + args.chunk]
                    t0 = time.perf_counter()
                    obs_list, rewards, terms, truncs, infos_list = env.chunk_step(part)
                    chunk_seconds.append(time.perf_counter() - t0)
                    if "chunk" not in result.setdefault("types", {}):
                        result["types"]["chunk"] = {
                            "obs_list": _describe(obs_list), "rewards": _describe(rewards),
                            "terminations": _describe(terms), "truncations": _describe(truncs),
                            "infos_list": _describe(infos_list)}
                    chunks.append({"rewards": _np(rewards).tolist(),
                                   "terminations": _np(terms).tolist(),
                                   "truncations": _np(truncs).tolist(),
                                   "last_infos_keys": sorted(infos_list[-1]),
                                   "last_episode": _jsonable(infos_list[-1].get("episode", {})),
                                   "last_final_info_episode": _jsonable(
                                       (infos_list[-1].get("final_info") or {}).get("episode")),
                                   "last_final_observation_sha256": (
                                       [hashlib.sha256(np.ascontiguousarray(f).tobytes()).hexdigest()
                                        for f in _np(infos_list[-1]["final_observation"]["main_images"])]
                                       if "final_observation" in infos_list[-1] else None),
                                   "returned_obs_sha256": [
                                       hashlib.sha256(np.ascontiguousarray(f).tobytes()).hexdigest()
                                       for f in _np(obs_list[-1]["main_images"])]})
            else:
                for i in range(args.steps):
                    env.step(actions[:, i], auto_reset=True)

            hook = getattr(env, "vlm_reward", None)
            if hook is not None:
                stats = getattr(hook.client, "stats", None)
                result["hook"] = {"episodes_scored": hook.episodes_scored, "failures": hook.failures,
                                  "client_stats": _jsonable(vars(stats)) if hasattr(stats, "__dict__") else None}
                hook.close()
            result["patched_attr_vlm_reward"] = hasattr(env, "vlm_reward")
        finally:
            close_t0 = time.perf_counter()
            env.env.close()
            result.setdefault("timings", {})["close_s"] = time.perf_counter() - close_t0

        result.setdefault("types", {}).update(rec.types)
        result["task_descriptions"] = rec.task_descriptions
        result["rewards"] = rec.rewards  # [step][env]
        result["terminations"] = rec.terminations
        result["truncations"] = rec.truncations
        result["episode"] = rec.episode  # infos["episode"] of each step
        result["info_keys"] = rec.info_keys
        result["chunks"] = chunks
        result["frame_sha256"] = rec.frame_sha  # [0] = reset, [t] = after step t
        result["wrist_sha256"] = rec.wrist_sha
        result["states"] = rec.states
        result["main_images"] = {"count": len(rec.frames), "shape": list(rec.frames[0].shape),
                                 "dtype": str(rec.frames[0].dtype)}
        result["timings"].update({"import_s": import_s, "init_s": init_s, "reset_s": reset_s,
                                  "step_s": rec.step_seconds, "chunk_s": chunk_seconds,
                                  "step_mean_s": float(np.mean(rec.step_seconds)) if rec.step_seconds else None})
        result["digest"] = hashlib.sha256(json.dumps(
            [rec.frame_sha, rec.rewards, rec.terminations, rec.truncations, rec.task_descriptions],
            sort_keys=True).encode()).hexdigest()

        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            if args.out.suffix == ".npz":
                np.savez_compressed(args.out, main_images=np.stack(rec.frames),
                                    result_json=np.array(json.dumps(result)))
            else:
                full = dict(result)
                full["frames_npy_b64"] = {"reset": _npy_b64(rec.frames[0]), "last": _npy_b64(rec.frames[-1])}
                args.out.write_text(json.dumps(full, indent=1))
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    summary = {k: result.get(k) for k in ("digest", "module_file", "hook")}
    summary["task_descriptions"] = (result.get("task_descriptions") or [None])[0]
    summary["timings"] = {k: v for k, v in result.get("timings", {}).items() if not isinstance(v, list)}
    summary["rewards_sum"] = ([sum(col) for col in zip(*result["rewards"], strict=True)]
                              if result.get("rewards") else None)
    if "patch" in result:
        summary["patch"] = result["patch"]
    if args.print_config:
        summary = {"config": result["config"]}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
