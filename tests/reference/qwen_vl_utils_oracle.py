"""qwen-vl-utils as the reference for frame sizes. Runs in the REFERENCE env (scripts/reference_env.sh),
which has qwen-vl-utils, torch and torchvision; the tests in the main env never import them.

stdin:  {"smart_resize": [[h, w, min_pixels, max_pixels], ...],
         "videos": [{"path": ".../x.mp4", "nframes": N, "max_pixels": M or null}, ...]}
stdout: {"version": "...", "smart_resize": [[h, w] or null, ...],
         "videos": [{"frames": T, "height": H, "width": W} or {"error": "..."}, ...]}
A case the reference refuses (it raises, or returns a 0 side) is null / {"error"}.

Videos go through qwen-vl-utils' own `fetch_video` (its frame count and per-frame size rules);
only the decoder is ours: torchvision 0.28 has no `io.read_video` any more, so the reader
registered below decodes with OpenCV and then samples exactly as `_read_video_torchvision`
does (smart_nframes, then linspace(...).round()). Only sizes are reported, so fetch_video's last
step, torchvision's bicubic resize to the size its own smart_resize chose, is replaced by a
tensor of that size (`_resized_shape`): it was 83% of the oracle's time (175 videos), and a
torchvision resize to [h, w] is h x w by definition.
"""

from __future__ import annotations

import functools
import json
import sys
import types
from importlib.metadata import version


@functools.lru_cache(maxsize=2)
def _decode(path: str):
    """Every frame of a file, decoded once: the grid asks for each video 25 times (a file's frames
    do not depend on the case; qwen-vl-utils' sampling and resizing still run per case)."""
    import cv2
    import numpy as np
    import torch

    capture = cv2.VideoCapture(path)
    frames, video_fps = [], capture.get(cv2.CAP_PROP_FPS)
    while True:
        ok, bgr = capture.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB).transpose(2, 0, 1))
    capture.release()
    return torch.from_numpy(np.stack(frames)), video_fps


def _resized_shape(video, size, **_kwargs):
    """torchvision's resize(video, [h, w]) as far as its shape goes."""
    import torch

    height, width = size
    if not (isinstance(height, int) and isinstance(width, int)):  # not an error of the reference's rules
        raise TypeError(f"resize to {size!r}: the oracle's stand-in takes two ints")
    return torch.empty((*video.shape[:-2], height, width), dtype=video.dtype)


def _opencv_reader(element: dict):
    import torch
    from qwen_vl_utils import vision_process

    video, video_fps = _decode(element["video"])
    total_frames = video.size(0)
    nframes = vision_process.smart_nframes(element, total_frames=total_frames, video_fps=video_fps)
    idx = torch.linspace(0, total_frames - 1, nframes).round().long()
    metadata = {"fps": video_fps, "frames_indices": idx, "total_num_frames": total_frames,
                "video_backend": "opencv"}
    return video[idx], metadata, nframes / max(total_frames, 1e-6) * video_fps


def main() -> None:
    request = json.load(sys.stdin)
    from qwen_vl_utils import vision_process

    vision_process.VIDEO_READER_BACKENDS["torchvision"] = _opencv_reader
    vision_process.get_video_reader_backend = lambda: "torchvision"
    vision_process.transforms = types.SimpleNamespace(functional=types.SimpleNamespace(resize=_resized_shape))

    resized = []
    for h, w, lo, hi in request.get("smart_resize", []):
        try:
            out = vision_process.smart_resize(h, w, factor=28, min_pixels=lo, max_pixels=hi)
        except (ValueError, AssertionError):
            out = None
        resized.append(None if out is None or 0 in out else list(out))
    videos = []
    for case in request.get("videos", []):
        element = {"type": "video", "video": case["path"], "nframes": case["nframes"]}
        if case.get("max_pixels") is not None:
            element["max_pixels"] = case["max_pixels"]
        try:
            video = vision_process.fetch_video(element)
        except (ValueError, AssertionError) as err:
            videos.append({"error": f"{type(err).__name__}: {err}"})
            continue
        frames, _, height, width = video.shape
        videos.append({"frames": int(frames), "height": int(height), "width": int(width)})
    json.dump({"version": version("qwen-vl-utils"), "smart_resize": resized, "videos": videos}, sys.stdout)


if __name__ == "__main__":
    main()
