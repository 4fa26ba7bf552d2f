"""A stand-in for RLinf's LiberoEnv with integrations/rlinf/libero_env.patch applied.

Same attributes and the same reset / step / chunk_step / reward / metrics flow as upstream
(`rlinf/envs/libero/libero_env.py`), with the simulator replaced by a schedule: env i succeeds
from step `success_steps[i]` on (None = never), and its frame at step t is tagged (i, t).
No torch: arrays stay numpy (RLinf wraps them with `to_tensor`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlinf_client.hook import LiberoVLMReward
from tests.client._support import tagged_frames


class StandInLiberoEnv:
    def __init__(self, cfg: dict[str, Any], success_steps: list[int | None], *, client: Any = None,
                 obs_key: str = "main_images", frame_size: int = 16, wrist: bool = False) -> None:
        self.cfg = cfg
        self.num_envs = len(success_steps)
        self.success_steps = success_steps
        self.task_descriptions = [f"task for env {i}" for i in range(self.num_envs)]
        self.task_ids = np.arange(self.num_envs) % 10  # LIBERO-10 task index per env
        self.ignore_terminations = cfg["ignore_terminations"]
        self.auto_reset = cfg["auto_reset"]
        self.use_rel_reward = cfg["use_rel_reward"]
        self.use_step_penalty = cfg.get("use_step_penalty", False)
        self.obs_key = obs_key
        self.frame_size = frame_size
        self.wrist = wrist  # also a `wrist_images` view (as RLinf's LiberoEnv returns): pure blue, 200
        self.prev_step_reward = np.zeros(self.num_envs)
        self._elapsed_steps = np.zeros(self.num_envs, dtype=np.int32)
        self._init_metrics()
        # --- patch: the reward model (None when env.*.reward_model.enable is off) ---
        self.vlm_reward = LiberoVLMReward.from_env_cfg(cfg, self.num_envs, client=client)

    # -- the fake simulator ------------------------------------------------------------------------
    def _simulate(self) -> tuple[np.ndarray, np.ndarray]:
        frames = np.concatenate([tagged_frames(i, range(int(t), int(t) + 1), self.frame_size)
                                 for i, t in enumerate(self._elapsed_steps)])
        success = np.array([s is not None and t >= s
                            for s, t in zip(self.success_steps, self._elapsed_steps, strict=True)])
        return frames, success

    def _wrap_obs(self, frames: np.ndarray) -> dict[str, Any]:
        images: Any = frames
        if self.obs_key == "images":  # RLinf v0.1: channels first
            images = frames.transpose(0, 3, 1, 2)
        elif self.obs_key == "full_images":  # the seed's fork: float frames in [0, 1] here
            images = frames.astype(np.float32) / 255.0
        obs = {self.obs_key: images, "task_descriptions": self.task_descriptions}
        if self.wrist:
            wrist = np.zeros_like(frames)
            wrist[..., 2] = 200
            obs["wrist_images"] = wrist
        return obs

    # -- RLinf's flow --------------------------------------------------------------------------------
    def _init_metrics(self) -> None:
        self.success_once = np.zeros(self.num_envs, dtype=bool)
        self.returns = np.zeros(self.num_envs)

    def _reset_metrics(self, env_idx: np.ndarray) -> None:
        self.prev_step_reward[env_idx] = 0.0
        self.success_once[env_idx] = False
        self.returns[env_idx] = 0.0
        self._elapsed_steps[env_idx] = 0

    def _record_metrics(self, step_reward: np.ndarray, terminations: np.ndarray, infos: dict) -> dict:
        self.returns += step_reward * (~self.success_once)
        self.success_once = self.success_once | terminations
        infos["episode"] = {"success_once": self.success_once.copy(), "return": self.returns.copy(),
                            "episode_len": self._elapsed_steps.copy()}
        return infos

    def _calc_step_reward(self, terminations: np.ndarray) -> np.ndarray:
        reward = (-1 if self.use_step_penalty else 0) + self.cfg["reward_coef"] * terminations
        if self.use_rel_reward:
            diff = reward - self.prev_step_reward
            self.prev_step_reward = reward
            return diff
        return reward

    def reset(self, env_idx: Any = None) -> tuple[dict, dict]:
        env_idx = np.arange(self.num_envs) if env_idx is None else np.asarray(env_idx)
        self._reset_metrics(env_idx)
        frames, _ = self._simulate()
        obs = self._wrap_obs(frames)
        # --- patch ---
        if self.vlm_reward is not None:
            self.vlm_reward.on_reset(obs, env_idx)
        return obs, {}

    def step(self, actions: Any = None, auto_reset: bool = True):
        self._elapsed_steps += 1
        frames, terminations = self._simulate()
        infos: dict[str, Any] = {}
        truncations = self._elapsed_steps >= self.cfg["max_episode_steps"]
        obs = self._wrap_obs(frames)
        # --- patch: reward model in place of the success flag ---
        if self.vlm_reward is not None:
            step_reward = self.vlm_reward.step_reward(obs, terminations, truncations,
                                                      self.task_descriptions,
                                                      task_ids=getattr(self, "task_ids", None))
        else:
            step_reward = self._calc_step_reward(terminations)
        infos = self._record_metrics(step_reward, terminations, infos)
        if self.vlm_reward is not None:
            infos["episode"].update(self.vlm_reward.episode_info())
        if self.ignore_terminations:
            infos["episode"]["success_at_end"] = terminations.copy()
            terminations[:] = False
        dones = terminations | truncations
        if dones.any() and auto_reset and self.auto_reset:
            final_info = infos
            obs, infos = self.reset(np.flatnonzero(dones))
            infos["final_info"] = final_info
        return obs, step_reward, terminations, truncations, infos

    def chunk_step(self, chunk_size: int):
        rewards, terminations, truncations, infos_list = [], [], [], []
        for _ in range(chunk_size):
            _, reward, term, trunc, infos = self.step(auto_reset=False)
            rewards.append(reward)
            terminations.append(term)
            truncations.append(trunc)
            infos_list.append(infos)
        return (np.stack(rewards, axis=1), np.stack(terminations, axis=1),
                np.stack(truncations, axis=1), infos_list)
