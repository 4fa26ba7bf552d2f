"""The RLinf hook: terminal VLM rewards for `rlinf/envs/libero/libero_env.py`'s `LiberoEnv`.

`LiberoVLMReward` keeps a bounded frame buffer per env and episode, scores every episode that
ended in a step in one concurrent call, and turns the scores into that step's rewards exactly
as `LiberoEnv._calc_step_reward` turns success flags into rewards (see `mapping`). Three calls
in `LiberoEnv` wire it in (integrations/rlinf/ has the patch):

    __init__: self.vlm_reward = LiberoVLMReward.from_env_cfg(cfg, self.num_envs)   # None = off
    reset:    self.vlm_reward.on_reset(obs, env_idx)
    step:     step_reward = self.vlm_reward.step_reward(obs, terminations, truncations,
                                                        self.task_descriptions)
              ... infos["episode"].update(to_tensor(self.vlm_reward.episode_info()))

An episode ends on termination or truncation, or on truncation only with
`ignore_terminations`; it is scored once, with its env's task text, and the simulator's success
flag travels with the request as metadata (the proxy's audit log, never the model). A failed
request follows `reward_model.fallback` (raise, zero, or env_success — the simulator's flag,
never the default), mapped the same way, marked in `vlm_fallback` and counted in `failures`.

An answer whose `quality.status` is `alarm` (the proxy's live monitor: for this run, backend and
task the reward disagrees with the simulator's success beyond a bound) is marked in
`vlm_quality_alarm`, counted in `quality_alarms`, warned about once per step, and paid per
`reward_model.on_quality_alarm`: the VLM's score (keep), the simulator's reward as `env_success`
pays it, marked in `vlm_fallback` too (native), or `QualityAlarmError` (raise). An answer without
`quality` (an older proxy) or with `ok` / `unknown` is paid as before.

With `reward_source: progress` (run D) the episodes that ended in the step go to the proxy's
/progress/batch instead, with their task ids and success flags (`mapping.map_progress`); a failure
the proxy could not rate (no_reference) is paid the native reward and marked in
`vlm_no_reference`, or stops the run (`on_no_reference: raise`). Nothing here imports RLinf, torch
or OpenCV.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlinf_client._client import RewardClient
from rlinf_client._config import RewardModelConfig
from rlinf_client._exceptions import FramesError, NoReferenceError, QualityAlarmError
from rlinf_client._frames import EpisodeFrameBuffer, _as_numpy, env_frames_from_obs, to_uint8_frames
from rlinf_client._quality import Paid, alarm_summary, quality_alarm
from rlinf_client._types import Episode
from rlinf_client.mapping import map_progress, map_score, relative_step_reward
from rlinf_client.shaping import potential_rewards

__all__ = ["LiberoVLMReward"]

log = logging.getLogger("rlinf_client")


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    """A key of a dict or an OmegaConf node (both have .get)."""
    return cfg.get(key, default) if cfg is not None else default


def _bools(data: Any) -> np.ndarray:
    return np.asarray(_as_numpy(data), dtype=bool).reshape(-1)


class LiberoVLMReward:
    def __init__(self, config: RewardModelConfig | Mapping[str, Any] | None, num_envs: int, *,
                 reward_coef: float, use_rel_reward: bool, ignore_terminations: bool,
                 use_step_penalty: bool = False, client: Any = None) -> None:
        self.config = (config if isinstance(config, RewardModelConfig)
                       else RewardModelConfig.from_mapping(config))
        self.identity = self.config.identity  # metadata.run and the reference namespace: one name
        if self.identity is not None:
            how = ("resumed (reward_model.resume)" if self.config.resume else
                   "new for this launch (reward_model.job)" if self.config.job else
                   "the label alone (no reward_model.job: every launch shares it)")
            log.info("reward model: run identity %r, %s; to carry on with this run's references and quality "
                     "windows after a restart, set reward_model.resume: %s", self.identity, how, self.identity)
        self.num_envs = num_envs
        self.reward_coef = float(reward_coef)
        self.use_rel_reward = bool(use_rel_reward)
        self.ignore_terminations = bool(ignore_terminations)
        self.step_penalty = -1.0 if use_step_penalty else 0.0
        self._owns_client = client is None
        # Anything with score_episodes(list[Episode]) -> list[EpisodeScore] will do (reward_source:
        # progress: progress_episodes(list[Episode]) -> list[EpisodeProgress]).
        self.client = client if client is not None else RewardClient(self.config)
        self.buffers = [EpisodeFrameBuffer(self.config.buffer_frames, self.config.frame_stride)
                        for _ in range(num_envs)]
        # reward_model.extra_view names a second camera in the observation (wrist_images): buffered
        # beside the main view, step for step, and sent with it
        self.extra_buffers = [EpisodeFrameBuffer(self.config.buffer_frames, self.config.frame_stride)
                              for _ in range(num_envs)] if self.config.extra_view else None
        self.scored = np.zeros(num_envs, dtype=bool)  # this episode already has its reward
        self.terminal_value = np.zeros(num_envs)  # reward_coef * mapped from the end step on
        self.prev_value = np.zeros(num_envs)  # RLinf's prev_step_reward, for this path
        self.vlm_score = np.zeros(num_envs)  # the score behind the reward (fallback included)
        self.vlm_fallback = np.zeros(num_envs)  # 1 where that score is the fallback
        self.vlm_no_reference = np.zeros(num_envs)  # progress: 1 where a failure had no reference
        self.vlm_frames_short = np.zeros(num_envs)  # 1 where fewer frames were sent than the episode allowed
        self.vlm_quality_alarm = np.zeros(num_envs)  # 1 where the proxy's answer said quality alarm
        self.failures = 0  # fallbacks since creation
        self.quality_alarms = 0  # episodes whose answer said quality alarm, since creation
        self.no_reference = 0  # progress: failures paid the native reward for want of a reference
        self.episodes_scored = 0
        self.episodes_started = np.zeros(num_envs, dtype=np.int64)  # per env, for episode ids
        # dense_points: each env's last scored curve as (episode step, score) points, and its steps
        self.curves: list[tuple[tuple[tuple[int, float], ...], int] | None] = [None] * num_envs

    @classmethod
    def from_env_cfg(cls, env_cfg: Any, num_envs: int, *, client: Any = None) -> LiberoVLMReward | None:
        """From RLinf's `env.train` / `env.eval` node; None when `reward_model.enable` is off."""
        block = _cfg_get(env_cfg, "reward_model")
        if not block:
            return None
        config = RewardModelConfig.from_mapping(block)  # a typo in the block fails here, enabled or not
        if not config.enable:
            return None
        return cls(config, num_envs,
                   reward_coef=_cfg_get(env_cfg, "reward_coef", 1.0),
                   use_rel_reward=_cfg_get(env_cfg, "use_rel_reward", False),
                   ignore_terminations=_cfg_get(env_cfg, "ignore_terminations", False),
                   use_step_penalty=_cfg_get(env_cfg, "use_step_penalty", False),
                   client=client)

    # -- the three calls ---------------------------------------------------------------------------
    def on_reset(self, obs: Mapping[str, Any], env_idx: Any = None) -> None:
        """New episodes for `env_idx` (None = all): empty buffers holding the reset frame."""
        ids = self._env_ids(env_idx)
        frames, extra = env_frames_from_obs(obs), self._extra_frames(obs)
        for env in ids:
            self.buffers[env].clear()
            self.buffers[env].append(frames[env])
            if self.extra_buffers is not None:
                self.extra_buffers[env].clear()
                self.extra_buffers[env].append(extra[env])
        self.scored[ids] = False
        self.episodes_started[ids] += 1
        for array in (self.terminal_value, self.prev_value, self.vlm_score, self.vlm_fallback, self.vlm_no_reference,
                      self.vlm_quality_alarm, self.vlm_frames_short):
            array[ids] = 0.0

    def step_reward(self, obs: Mapping[str, Any], terminations: Any, truncations: Any,
                    task_descriptions: Sequence[str], task_ids: Any = None) -> np.ndarray:
        """This step's reward for every env; scores the episodes that ended in it.

        `terminations` are the simulator's success flags as `env.step` returned them (before
        `ignore_terminations` clears them); `task_ids` (optional) go into the request metadata."""
        frames, extra = env_frames_from_obs(obs), self._extra_frames(obs)
        terminations, truncations = _bools(terminations), _bools(truncations)
        running = np.flatnonzero(~self.scored)
        for env in running:
            self.buffers[env].append(frames[env])
            if self.extra_buffers is not None:
                self.extra_buffers[env].append(extra[env])
        ended = truncations if self.ignore_terminations else terminations | truncations
        ending = np.flatnonzero(ended & ~self.scored)
        if ending.size:
            ids = None if task_ids is None else np.asarray(_as_numpy(task_ids)).reshape(-1)
            self._score(ending, terminations, task_descriptions, ids)
        value = self.step_penalty + self.terminal_value
        reward = relative_step_reward(value, self.prev_value, use_rel_reward=self.use_rel_reward)
        if self.use_rel_reward:
            self.prev_value = value
        return reward

    def episode_info(self) -> dict[str, np.ndarray]:
        """Per-env values for `infos["episode"]` (RLinf logs them as env/vlm_score and
        env/vlm_fallback: means over episodes, so env/vlm_fallback is the fallback rate). With
        reward_source: progress, vlm_score is the progress (1 for a success) and vlm_no_reference
        marks the failures paid the native reward for want of a reference (env/vlm_no_reference).
        With reward_source: score, vlm_quality_alarm marks the episodes whose answer said quality
        alarm (env/vlm_quality_alarm: the alarmed share; progress answers carry no quality).
        vlm_frames_short marks the episodes scored on fewer frames (or curve points) than asked and the
        episode allowed: the frame buffer's stride, the backend's clamp, a short curve (the result's
        frames_short says which; env/vlm_frames_short: their share)."""
        info = {"vlm_score": self.vlm_score.astype(np.float32), "vlm_fallback": self.vlm_fallback.astype(np.float32),
                "vlm_frames_short": self.vlm_frames_short.astype(np.float32)}
        if self.config.reward_source == "progress":
            info["vlm_no_reference"] = self.vlm_no_reference.astype(np.float32)
        else:
            info["vlm_quality_alarm"] = self.vlm_quality_alarm.astype(np.float32)
        return info

    def shaped_rewards(self, env: int) -> np.ndarray | None:
        """With dense_points: env's last scored episode as per-step potential differences (one per
        frame, the reset frame first; they add up to the reward paid on its end step). None when
        dense_points is off or that episode was rewarded by the fallback. RLinf's LiberoEnv returns a
        step's reward at that step, so this is for trainers that take an episode's rewards at its end."""
        if self.curves[env] is None:
            return None
        curve, steps = self.curves[env]
        return potential_rewards(curve, steps, self.reward_coef)

    def close(self) -> None:
        if self._owns_client:
            self.client.close()

    # -- internals -------------------------------------------------------------------------------
    def _extra_frames(self, obs: Mapping[str, Any]) -> np.ndarray | None:
        """The second camera's frame of every env (reward_model.extra_view's key), or None when off."""
        key = self.config.extra_view
        if key is None:
            return None
        if obs.get(key) is None:
            raise FramesError(f"reward_model.extra_view is {key!r}, but the observation has no {key!r}; "
                              f"keys: {sorted(obs)}")
        return to_uint8_frames(obs[key])

    def _env_ids(self, env_idx: Any) -> np.ndarray:
        if env_idx is None:
            return np.arange(self.num_envs)
        return np.atleast_1d(np.asarray(_as_numpy(env_idx), dtype=np.int64))

    def _score(self, envs: np.ndarray, terminations: np.ndarray, task_descriptions: Sequence[str],
               task_ids: np.ndarray | None) -> None:
        episodes = [Episode(self.buffers[env], str(task_descriptions[env]), fallback=float(terminations[env]),
                            metadata=self._metadata(env, terminations, task_ids, str(task_descriptions[env])),
                            extra_view=self.extra_buffers[env] if self.extra_buffers is not None else None)
                    for env in envs]
        if self.config.reward_source == "progress":
            paid = self._progress_values(episodes)
        else:
            paid = self._score_values(envs, episodes)
        reasons: Counter[str] = Counter()
        for env, (score, shown, result, native, alarm) in zip(envs, paid, strict=True):
            mapped = map_score(score, binary_reward=self.config.binary_reward,
                               success_threshold=self.config.success_threshold)
            self.terminal_value[env] = self.reward_coef * mapped
            self.vlm_score[env] = shown
            self.vlm_fallback[env] = 0.0 if result.ok and not native else 1.0
            self.vlm_quality_alarm[env] = 1.0 if alarm else 0.0
            no_reference = result.ok and getattr(result, "outcome", None) == "no_reference"
            self.vlm_no_reference[env] = 1.0 if no_reference else 0.0
            self.vlm_frames_short[env] = 1.0 if getattr(result, "frames_short", None) is not None else 0.0
            self.scored[env] = True
            self.buffers[env].clear()  # the frames are no longer needed
            if self.extra_buffers is not None:
                self.extra_buffers[env].clear()
            if not result.ok:
                reasons[result.reason or "unknown"] += 1
        self.episodes_scored += len(envs)
        if reasons:
            self.failures += sum(reasons.values())
            log.warning("reward model: %d of %d episodes ending now were rewarded by the fallback (%s), "
                        "not the VLM (%s); %d fallbacks so far", sum(reasons.values()), len(envs),
                        self.config.failure_policy, ", ".join(f"{k} x{v}" for k, v in reasons.items()),
                        self.failures)

    def _score_values(self, envs: np.ndarray, episodes: list[Episode]) -> list[Paid]:
        """What each episode is paid from /score (raises under fallback: raise), quality alarms
        handled per on_quality_alarm (all raised together, before any reward changes)."""
        results = self.client.score_episodes(episodes)
        alarms = [quality_alarm(result) for result in results]
        flagged = [alarm for alarm in alarms if alarm is not None]
        policy = self.config.on_quality_alarm
        if flagged and policy == "raise":
            raise QualityAlarmError(f"{len(flagged)} of {len(results)} episodes ending now came with a reward-quality "
                                    f"alarm ({alarm_summary(flagged)}); on_quality_alarm: raise", tuple(flagged))
        paid = []
        for env, episode, result, alarm in zip(envs, episodes, results, alarms, strict=True):
            native = alarm is not None and policy == "native"
            scored = bool(result.ok and result.curve) and not native
            self.curves[env] = (result.curve, self.buffers[env].count) if scored else None
            value = episode.fallback if native else result.value  # native: what fallback: env_success pays
            paid.append(Paid(value, value, result, native=native, alarm=alarm is not None))
        if flagged:
            self._warn_alarms(flagged, len(results))
        return paid

    def _warn_alarms(self, flagged: list[dict[str, Any]], ending: int) -> None:
        self.quality_alarms += len(flagged)
        paid = ("the simulator's reward instead (marked in vlm_fallback)" if self.config.on_quality_alarm == "native"
                else "the VLM's score all the same")
        log.warning("reward model: %d of %d episodes ending now came with a reward-quality alarm from the proxy "
                    "(%s); paid %s (on_quality_alarm: %s); %d alarmed episodes so far", len(flagged), ending,
                    alarm_summary(flagged), paid, self.config.on_quality_alarm,
                    self.quality_alarms)

    def _progress_values(self, episodes: list[Episode]) -> list[Paid]:
        """(score, progress, result) per episode from /progress/batch. The score: 1 for a success,
        progress x progress_coef for a failure, the fallback's value for a failed item, and for a
        failure without a reference the native reward (0) or NoReferenceError (on_no_reference).
        The progress (logged as vlm_score): the proxy's, else the score."""
        results = self.client.progress_episodes(episodes)  # raises under fallback: raise
        missing = [e for e, r in zip(episodes, results, strict=True) if r.ok and r.outcome == "no_reference"]
        if missing and self.config.on_no_reference == "raise":
            tasks = sorted({str(e.metadata["task_id"]) for e in missing})  # type: ignore[index]
            raise NoReferenceError(f"{len(missing)} failed episode(s) of task(s) {', '.join(tasks)} had no success "
                                   "of their task to compare with (outcome no_reference); on_no_reference: raise")
        paid = []
        for episode, result in zip(episodes, results, strict=True):
            if not result.ok:
                paid.append(Paid(result.value, result.value, result))
                continue
            score = map_progress(result.outcome, result.progress, progress_coef=self.config.progress_coef)
            if score is None:  # no reference: the native reward, never a made-up progress
                paid.append(Paid(episode.fallback, episode.fallback, result))
            else:
                paid.append(Paid(score, result.progress, result))
        if missing:
            self.no_reference += len(missing)
            log.warning("reward model: %d of %d episodes ending now failed with no success of their task to "
                        "compare with (no_reference); paid the native reward (0); %d so far", len(missing),
                        len(episodes), self.no_reference)
        return paid

    def _metadata(self, env: int, terminations: np.ndarray, task_ids: np.ndarray | None,
                  task_text: str) -> dict[str, Any]:
        metadata: dict[str, Any] = {"env_success": bool(terminations[env]), "env": int(env),
                                    "episode_id": f"env{env}-ep{int(self.episodes_started[env])}",
                                    "step": int(self.buffers[env].count) - 1}
        if self.identity:
            metadata["run"] = self.identity
        if self.config.reward_source == "score":  # the proxy's live monitor judges "says success" as we map it
            metadata["success_threshold"] = float(self.config.success_threshold)
        if task_ids is not None and env < len(task_ids):
            metadata["task_id"] = task_ids[env].item() if hasattr(task_ids[env], "item") else task_ids[env]
        elif self.config.reward_source == "progress":  # progress groups episodes by task: the text names it
            metadata["task_id"] = _text_task_id(task_text)
        return metadata


def _text_task_id(task_text: str) -> str:
    """The task text as a task id, within the proxy's 256 characters for a metadata string."""
    if len(task_text) <= 256:
        return task_text
    return task_text[:200] + "#" + hashlib.sha256(task_text.encode()).hexdigest()[:16]
