"""See the proxy work end to end without a GPU: fake vLLM servers + the real proxy + one episode.

Starts two fake `vllm serve` (Qwen2.5-VL and PRIMO-R1 stand-ins) and the proxy on
configs/libero.yaml's backends, writes a synthetic 512-frame MP4 episode under /tmp, scores it
with both backends and prints the responses (and the request JSON sent upstream, frames elided).

    python scripts/demo.py
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from proxy.config import settings_from_dict  # noqa: E402
from tests.fakes.episodes import episode_frames, write_mp4  # noqa: E402
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread  # noqa: E402
from tests.fakes.proxy_server import ProxyServerThread  # noqa: E402

# Replies in the shipped templates' declared formats: prompts/qwen_seed.yaml wants the bare
# number, prompts/primo_r1_trained.yaml reasoning then <answer>.
PRIMO_REPLY = ("<think><planning>1. reach the bowl 2. grasp it 3. place it on the plate</planning>"
               "<observation>the bowl ends on the plate</observation><reasoning>all steps done"
               "</reasoning></think><answer>95</answer>")


def _elide(body: dict) -> str:
    text = json.dumps(body, indent=1)
    return re.sub(r"data:(video|image)/jpeg;base64,[A-Za-z0-9+/=,]+",
                  lambda m: f"data:{m.group(1)}/jpeg;base64,<{m.group(0).count(',')} JPEG frame(s)>", text)


def main() -> int:
    config = yaml.safe_load((REPO / "configs" / "libero.yaml").read_text())
    with tempfile.TemporaryDirectory(dir="/tmp") as media, \
            FakeVLLMThread(FakeConfig(served_model_name="Qwen2.5-VL-7B-Instruct",
                                      default_text="90")) as qwen, \
            FakeVLLMThread(FakeConfig(served_model_name="PRIMO-R1-7B", default_text=PRIMO_REPLY)) as primo:
        config["backends"]["qwen2_5_vl_vllm"]["endpoints"] = [qwen.base_url]
        config["backends"]["PRIMO-R1"]["endpoints"] = [primo.base_url]
        config["proxy"].update(prompts_dir=str(REPO / "prompts"), allowed_media_roots=[media])
        episode = write_mp4(Path(media) / "episode.mp4", episode_frames(512, 256, 256), fps=20)
        with ProxyServerThread(settings_from_dict(config)) as proxy, \
                httpx.Client(base_url=proxy.url, timeout=60, trust_env=False) as http:
            print(f"proxy on {proxy.url}; fake vLLM on {qwen.base_url} and {primo.base_url}\n")
            for backend, fake in (("qwen2_5_vl_vllm", qwen), ("PRIMO-R1", primo)):
                response = http.post("/score", json={"task_text": "put the black bowl on the plate",
                                                     "video_path": str(episode), "backend": backend})
                result = response.json()
                if response.status_code != 200:
                    print(f"{backend}: HTTP {response.status_code} {result}")
                    return 1
                result["frames"]["sha256"] = f"<{len(result['frames']['sha256'])} hashes>"
                print(f"=== POST /score backend={backend} -> {response.status_code}")
                for key, value in result.items():
                    print(f"  {key}: {json.dumps(value)}")
                print(f"--- what the proxy sent to vllm serve:\n{_elide(fake.chat_requests[-1])}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
