"""`vlm-reward-proxy sample-episode`: write a synthetic robot episode as an MP4 where the proxy may
read it, so the README's `curl` has a `video_path` to score before any real episode exists.

The episode is drawn, not simulated: a bowl slides across a table onto a plate, seen from above at
LIBERO's 256x256 and 20 fps. The file goes under the proxy's media root (`/tmp/vlm-reward-media` in
the shipped configs, or the first of `proxy.allowed_media_roots` of `--config`), which is created
owner-only (0700) and checked by the proxy's own rule: a root the proxy would refuse is refused here.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from proxy.errors import ConfigError

__all__ = ["DEFAULT_MEDIA_ROOT", "DEFAULT_NAME", "add_subcommand", "episode_frames", "write_episode"]

DEFAULT_MEDIA_ROOT = Path("/tmp/vlm-reward-media")  # proxy.allowed_media_roots of the shipped configs
DEFAULT_NAME = "episode_0001.mp4"
TASK_TEXT = "put the black bowl on the plate"


def episode_frames(count: int, size: int) -> Any:
    """count x size x size x 3 uint8 RGB: the bowl moves from the left edge onto the plate."""
    import numpy as np

    rows, cols = np.mgrid[0:size, 0:size]
    table = np.empty((size, size, 3), np.uint8)
    table[...] = (181, 148, 110)  # wood
    plate_centre = (0.5 * size, 0.68 * size)
    plate = (rows - plate_centre[0]) ** 2 + (cols - plate_centre[1]) ** 2 <= (0.16 * size) ** 2
    table[plate] = (236, 236, 230)
    frames = np.empty((count, size, size, 3), np.uint8)
    for index in range(count):
        progress = min(1.0, index / max(1, int(0.8 * (count - 1))))  # it rests on the plate at the end
        centre = (0.5 * size + 0.18 * size * np.sin(np.pi * progress), (0.15 + 0.53 * progress) * size)
        bowl = (rows - centre[0]) ** 2 + (cols - centre[1]) ** 2 <= (0.08 * size) ** 2
        frames[index] = table
        frames[index][bowl] = (28, 28, 32)
    return frames


def write_episode(path: Path, *, frames: int = 160, size: int = 256, fps: float = 20.0) -> Path:
    """Write the episode to `path` (MP4, mp4v) through a temporary name, so a reader never sees half."""
    import cv2

    partial = path.with_name(f".{path.stem}.partial.mp4")
    writer = cv2.VideoWriter(str(partial), cv2.VideoWriter_fourcc(*"mp4v"), fps, (size, size))
    if not writer.isOpened():
        raise ConfigError(f"OpenCV cannot write an MP4 (mp4v) to {partial}")
    try:
        for frame in episode_frames(frames, size):
            writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    finally:
        writer.release()
    os.replace(partial, path)
    return path


def _media_root(config: str | None) -> Path:
    if config is None:
        return DEFAULT_MEDIA_ROOT
    from proxy.config import load_settings

    roots = load_settings(config).proxy.allowed_media_roots
    if not roots:
        raise ConfigError(f"{config} allows no media root (proxy.allowed_media_roots): it reads no video_path")
    return roots[0]


def _run(args: argparse.Namespace) -> int:
    from proxy.media.file import prepare_media_roots

    if args.out_file is not None and args.config is not None:
        raise ConfigError("give --out-file or --config, not both")
    out = Path(args.out_file) if args.out_file is not None else _media_root(args.config) / DEFAULT_NAME
    out = out.absolute()
    if args.frames < 2 or not 28 <= args.size <= 1024 or not 0 < args.fps <= 1000:
        raise ConfigError("--frames must be 2 or more, --size within [28, 1024] and --fps within (0, 1000]")
    # The proxy's own start-up rule: created 0700 when missing, refused when another user could write to it.
    prepare_media_roots([out.parent])
    if out.exists() and not args.force:
        raise ConfigError(f"{out} exists; pass --force to overwrite it")
    write_episode(out, frames=args.frames, size=args.size, fps=args.fps)
    print(f"wrote {out}: {args.frames} frames of {args.size}x{args.size} at {args.fps:g} fps "
          f"(a synthetic episode: {TASK_TEXT})")
    print("score it (the proxy must list its folder in proxy.allowed_media_roots):\n"
          f"  curl -s localhost:18080/score -H 'content-type: application/json' "
          f"-d '{{\"task_text\": \"{TASK_TEXT}\", \"video_path\": \"{out}\"}}'")
    return 0


def add_subcommand(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "sample-episode", help="write a synthetic episode MP4 where the proxy reads video_path",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-file", default=None, metavar="FILE",
                        help=f"the MP4 to write (default: {DEFAULT_MEDIA_ROOT / DEFAULT_NAME}, the shipped "
                             "configs' media root); its folder is created 0700 when missing")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help=f"write {DEFAULT_NAME} into the first of this config's proxy.allowed_media_roots")
    parser.add_argument("--frames", type=int, default=160, metavar="N", help="frames in the episode (default 160)")
    parser.add_argument("--size", type=int, default=256, metavar="PX",
                        help="frame width and height (default 256, LIBERO's camera)")
    parser.add_argument("--fps", type=float, default=20.0, metavar="FPS", help="frame rate (default 20, LIBERO's)")
    parser.add_argument("--force", action="store_true", help="overwrite the file if it exists")
    parser.set_defaults(func=_run)
