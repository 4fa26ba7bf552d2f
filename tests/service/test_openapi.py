"""The API document tells the truth: schemathesis fuzzes every operation of the running proxy from
its own /openapi.json (the document the app serves) and checks every answer against it — no 5xx,
every status and content type documented, schema-valid requests accepted, invalid ones refused.

What a valid value of the media fields is, the document says with custom formats; the strategies
below generate such values (images of one size, .npy arrays, paths of real videos under the
allowed root), so the fuzzer exercises the pipeline rather than only the validators. They also
yield what a format's name does not rule out — the empty string, a relative path — so that only
the document's own rules (minLength, pattern) keep those out of a valid request."""

from __future__ import annotations

import base64
import io
import json
import tempfile
from pathlib import Path

import cv2
import httpx
import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS, is_check_class, load_all_checks
from schemathesis.config import SchemathesisConfig

from proxy.config import endpoint_url, settings_from_dict
from proxy.protocol.common import IMAGE_FORMAT, MEDIA_PATH_FORMAT, NPY_FORMAT
from tests.conftest import PRIMO_MODEL, QWEN_MODEL, libero_settings_dict
from tests.fakes.episodes import write_mp4
from tests.fakes.fake_vllm import FakeConfig, FakeVLLMThread
from tests.fakes.proxy_server import ProxyServerThread
from tests.helpers import free_ports

pytestmark = pytest.mark.slow  # fuzzing every route: ~2 min, started early under xdist

MEDIA = tempfile.TemporaryDirectory(prefix="openapi-media-")
VIDEOS = [str(write_mp4(Path(MEDIA.name) / f"episode{i}.mp4", np.full((6, 32, 32, 3), 40 * i, np.uint8)))
          for i in range(3)]


def _png(level: int) -> str:
    ok, buffer = cv2.imencode(".png", np.full((32, 32, 3), level, np.uint8))
    assert ok
    return base64.b64encode(buffer.tobytes()).decode("ascii")


def _npy(count: int) -> str:
    buffer = io.BytesIO()
    np.save(buffer, np.full((count, 32, 32, 3), 99, np.uint8), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


schemathesis.openapi.format(IMAGE_FORMAT, st.one_of(st.just(""), st.integers(0, 255).map(_png)))
schemathesis.openapi.format(NPY_FORMAT, st.one_of(st.just(""), st.integers(1, 6).map(_npy)))
schemathesis.openapi.format(MEDIA_PATH_FORMAT, st.sampled_from(["", "episode0.mp4", *VIDEOS]))


@pytest.fixture(scope="module")
def running_proxy():
    # "1" is an answer on every scale a request may pick with score_mode (0-100, 0-1, binary)
    fakes = [FakeVLLMThread(FakeConfig(served_model_name=QWEN_MODEL, default_text="<score>1</score>",
                                       record=False)).start(),
             FakeVLLMThread(FakeConfig(served_model_name=PRIMO_MODEL, default_text="<answer>1</answer>",
                                       record=False)).start(),
             FakeVLLMThread(FakeConfig(served_model_name="fake-embed", record=False)).start()]
    for fake in fakes:  # a /compare query (it asks to "Reply -1 if …") gets a label, as on every template
        fake.fake.state.reply_fn = lambda body, default=fake.config.default_text: (
            "1" if "Reply -1" in json.dumps(body["messages"]) else default)
    data = libero_settings_dict([fakes[0].base_url], [fakes[1].base_url], Path(MEDIA.name), health_interval_s=30)
    for backend in data["backends"].values():
        backend["max_model_len"] = None  # content-dependent budgets are documented 422s, not schema rules
    data["backends"]["embed"] = {"model": "fake-embed", "kind": "embedding", "endpoints": [fakes[2].base_url],
                                 "retry": data["backends"]["qwen2_5_vl_vllm"]["retry"]}
    data["proxy"]["reference_store"] = {"dir": str(Path(MEDIA.name) / "references")}  # GET /progress/references
    proxy = ProxyServerThread(settings_from_dict(data)).start()
    yield proxy
    proxy.stop()
    for fake in fakes:
        fake.stop()
    MEDIA.cleanup()


# An invalid request may also be refused as too large (413: a generated list of frames over
# proxy.max_body_mb is refused by its size, before its schema is read): schemathesis' default list
# of rejections plus 413.
REJECTIONS = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]
FUZZ_CONFIG = SchemathesisConfig.from_dict({"checks": {"negative_data_rejection": {"expected-statuses": REJECTIONS}}})


@pytest.fixture(scope="module")
def api_document(running_proxy):
    return schemathesis.openapi.from_url(f"{running_proxy.url}/openapi.json", config=FUZZ_CONFIG)


# The shared proxy has no proxy.admin_api_key_env, so there the admin routes answer 403 whatever is sent
# (and change nothing); they are fuzzed with the admin key on a proxy of their own below.
ADMIN_OPERATIONS = ["GET /admin/endpoints", "POST /admin/endpoints", "POST /progress/references"]
OPERATIONS = ["GET /health", "GET /metrics", "GET /quality", "GET /frame-rules", "GET /v1/models", "POST /score",
              "POST /score/batch",
              "POST /score/dense", "POST /compare", "POST /compare/batch",
              "POST /v1/chat/completions", "POST /progress/batch", "GET /progress/references", *ADMIN_OPERATIONS]


def test_the_document_lists_every_route(api_document):
    assert sorted(op.ok().label for op in api_document.get_all_operations()) == sorted(OPERATIONS)


def _frame_count(body: dict) -> int | None:
    """Frames in a generated request's episode; None where its source cannot be read (the request
    is then answered as it was generated)."""
    if body.get("video_path") in VIDEOS:
        return 6
    if isinstance(body.get("frames"), list):
        return len(body["frames"])
    if body.get("frames_npy"):
        return int(np.load(io.BytesIO(base64.b64decode(body["frames_npy"]))).shape[0])
    return None


def _within_the_episode(case):
    """Where a frame index must exist in the episode (prefix_end, a dense curve's points), a
    content-dependent 422 the document cannot state: bring the index into the episode, or leave the
    case out when it cannot be (a one-frame episode has no curve). Caller-made stills beside frames and
    a frame rules id depend on the backend's layout and the proxy's current rules, which the document
    cannot state either: left out here (tests/client/test_ready_frames.py proves both); so does a
    second camera (extra_view), which a backend takes only when its frames.extra_view places one
    (tests/service/test_two_cameras.py). Stills beside another source are the document's to refuse:
    they stay."""
    body, count = case.body, None
    for episode in [body, *(body.get("items") or [])] if isinstance(body, dict) else []:
        if isinstance(episode, dict):
            if episode.get("frames") is not None:
                episode.pop("stills", None)
            episode.pop("frame_rules", None)
            episode.pop("extra_view", None)
    if case.operation.path.startswith("/progress/") and isinstance(body, dict) and isinstance(body.get("items"), list):
        items = [item for item in body["items"] if isinstance(item, dict)]
        for item in items:  # each item an episode, as a /score body
            if _index(item.get("prefix_end")) and (n := _frame_count(item)) is not None:
                item["prefix_end"] = min(int(item["prefix_end"]), n - 1)
            # The episodes of one request are embedded alike (one task, one embedding space: a rule
            # across items, which a schema cannot state).
            for key in ("max_pixels", "video_fps"):
                item[key] = items[0].get(key)
        return case
    if not isinstance(body, dict) or (count := _frame_count(body)) is None:
        return case
    if _index(body.get("prefix_end")):
        body["prefix_end"] = min(int(body["prefix_end"]), count - 1)
    if case.operation.path == "/score/dense":
        if count < 3:
            return None
        if isinstance(body.get("prefix_ends"), list) and all(_index(e) for e in body["prefix_ends"]):
            body["prefix_ends"] = sorted({min(int(e), count - 1) for e in body["prefix_ends"]})
            if len(body["prefix_ends"]) < 2:
                return None
        elif body.get("prefix_ends") is None and (body.get("points") is None or _index(body["points"])):
            body["points"] = min(int(body.get("points") or 8), count - 1)
    return case


def _index(value) -> bool:
    """A JSON number that is a frame index (an integer-valued float counts, as pydantic reads it)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0 and value == int(value)


# Every check schemathesis has (`--checks all`): the document's statuses, content types, headers and
# schemas, valid requests accepted (positive_data_acceptance) and invalid ones refused
# (negative_data_rejection), so each operation is fuzzed with both kinds of request.
load_all_checks()
ALL_CHECKS = [check for check in CHECKS.get_all() if not is_check_class(check)]
EXAMPLES = 150  # per operation and kind of request, as the issue's `st run --max-examples 150`


def _valid_and_invalid(operation):
    valid = operation.as_strategy().map(_within_the_episode).filter(lambda case: case is not None)
    return st.one_of(valid, operation.as_strategy(GenerationMode.NEGATIVE))


@pytest.mark.parametrize("label", OPERATIONS)
def test_every_answer_is_what_the_document_says(api_document, label):
    operation = next(op.ok() for op in api_document.get_all_operations() if op.ok().label == label)

    @given(case=_valid_and_invalid(operation))
    @settings(max_examples=EXAMPLES, suppress_health_check=list(HealthCheck), database=None)
    def fuzz(case):
        case.call_and_validate(checks=ALL_CHECKS)

    fuzz()


ADMIN_KEY = "fuzz-admin-token"


@pytest.fixture
def admin_proxy(monkeypatch, proxy_factory, fake_vllm_factory, tmp_path):
    """A proxy with the bearer token, of its own: POST /admin/endpoints changes what it serves, which
    must not happen to the shared proxy the other operations are fuzzed against. Its endpoints need
    not answer: nothing is scored there."""
    monkeypatch.setenv("ADMIN_FUZZ_KEY", ADMIN_KEY)
    qwen, primo = (f"http://127.0.0.1:{port}/v1" for port in free_ports(2))
    embed = fake_vllm_factory(served_model_name="fake-embed", record=False).base_url  # demonstrations get embedded
    data = libero_settings_dict([qwen], [primo], tmp_path, health_interval_s=30, admin_api_key_env="ADMIN_FUZZ_KEY")
    data["backends"]["embed"] = {"model": "fake-embed", "kind": "embedding", "endpoints": [embed],
                                 "retry": data["backends"]["qwen2_5_vl_vllm"]["retry"]}
    data["proxy"]["reference_store"] = {"dir": str(tmp_path / "references")}
    return proxy_factory(settings_from_dict(data))


def _removable(case, http, proxy) -> None:
    """Which URLs are a backend's endpoints changes at run time, so the document cannot say: in a
    valid request, keep to `remove` only the backend's endpoints that are not also added."""
    body = case.body
    if not isinstance(body, dict) or not body.get("remove"):
        return
    name = next(n for n, b in proxy.settings.backends.items() if body["backend"] in (n, b.model, *b.aliases))
    present = {e["url"] for e in http.get("/admin/endpoints").json()["backends"][name]}
    added = {endpoint_url(url) for url in body.get("add", [])}
    body["remove"] = [url for url in body["remove"] if endpoint_url(url) in present - added]


@pytest.mark.parametrize("label", ADMIN_OPERATIONS)
def test_the_admin_routes_answer_what_the_document_says_with_the_token(api_document, admin_proxy, label):
    operation = next(op.ok() for op in api_document.get_all_operations() if op.ok().label == label)
    token = {"authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=admin_proxy.url, headers=token, timeout=30, trust_env=False) as http:

        # valid requests and invalid ones: a bad URL, field or backend must be refused (422, 404)
        @given(case=st.one_of(operation.as_strategy(), operation.as_strategy(GenerationMode.NEGATIVE)))
        @settings(max_examples=60, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case):
            if case.meta is not None and case.meta.generation.mode.is_positive:
                _removable(case, http, admin_proxy)
                _within_the_episode(case)
            case.call_and_validate(base_url=admin_proxy.url, headers=token, checks=ALL_CHECKS)

        fuzz()
        assert http.get("/health").status_code in (200, 503)  # the proxy outlived it


def test_the_document_states_how_the_estimate_keys_combine(running_proxy, api_document):
    """A grid of backend_kwargs: whatever the document calls valid the proxy accepts (the document
    may be stricter: it asks for the temperature in the request, whatever the backend's default)."""
    import itertools

    import jsonschema_rs  # schemathesis' own validator

    document = httpx.get(f"{running_proxy.url}/openapi.json", timeout=10, trust_env=False).json()
    validator = jsonschema_rs.Draft202012Validator({"$ref": "#/components/schemas/ScoreRequest",
                                                    "components": document["components"]}, validate_formats=False)
    grid = itertools.product([None, 1, 3], [None, 2, 4], [None, 0.7], [None, True], [None, "binary"],
                             ["qwen2_5_vl_vllm", "PRIMO-R1"])
    accepted_by_both = 0
    with httpx.Client(base_url=running_proxy.url, timeout=30, trust_env=False) as http:
        for samples, quorum, temperature, logprob, mode, backend in grid:
            kwargs = {k: v for k, v in (("samples", samples), ("quorum", quorum), ("temperature", temperature),
                                        ("logprob_score", logprob), ("score_mode", mode)) if v is not None}
            body = {"task_text": "t", "backend": backend, "frames_npy": _npy(4), "backend_kwargs": kwargs}
            documented = validator.is_valid(body)
            status = http.post("/score", json=body).status_code
            assert status in (200, 422), (kwargs, status)
            if documented:
                assert status == 200, f"the document allows {kwargs} on {backend}, the proxy refused it"
                accepted_by_both += 1
    assert accepted_by_both >= 20  # the grid exercises valid combinations, not only refusals


def test_the_document_states_the_minimum_lengths_and_the_stills_rule(running_proxy):
    """What the proxy refuses for its shape, the document refuses too, so a client generated from it
    cannot build such a request: an empty image or .npy, a relative path, stills beside another source."""
    import jsonschema_rs  # schemathesis' own validator

    document = httpx.get(f"{running_proxy.url}/openapi.json", timeout=10, trust_env=False).json()

    def documented(name: str, body: dict) -> bool:
        return jsonschema_rs.Draft202012Validator({"$ref": f"#/components/schemas/{name}",
                                                   "components": document["components"]},
                                                  validate_formats=False).is_valid(body)

    png, npy, video = _png(9), _npy(3), VIDEOS[0]
    labelled = {"task_id": 1, "env_success": False}
    cases = [("ScoreRequest", {"frames": [png, png]}, {"frames": [png, ""]}),
             ("ScoreRequest", {"frames_npy": npy}, {"frames_npy": ""}),
             ("ScoreRequest", {"video_path": video}, {"video_path": "episode0.mp4"}),
             ("ScoreRequest", {"frames": [png, png], "stills": [png, png]}, {"frames_npy": npy, "stills": [png, png]}),
             ("ScoreRequest", {"frames": [png], "extra_view": {"frames": [png]}},
              {"frames": [png], "stills": [png, png], "extra_view": {"frames": [png]}}),
             ("ScoreRequest", {"video_path": video}, {"video_path": video, "stills": [png, png]}),
             ("DenseRequest", {"frames": [png, png, png]}, {"frames": [png, png, png], "stills": [png, png]}),
             ("DenseRequest", {"frames_npy": npy}, {"frames_npy": ""})]
    with httpx.Client(base_url=running_proxy.url, timeout=30, trust_env=False) as http:
        for name, valid, refused in cases:
            valid, refused = {"task_text": "t", **valid}, {"task_text": "t", **refused}
            assert documented(name, valid), (name, valid)
            assert not documented(name, refused), (name, refused)
            path = "/score/dense" if name == "DenseRequest" else "/score"
            assert http.post(path, json=refused).status_code == 422, refused
    compare = {"task_text": "t", "episodes": [{"frames": [png]}, {"frames_npy": ""}]}
    assert not documented("CompareRequest", compare)
    assert documented("CompareRequest", {**compare, "episodes": [{"frames": [png]}, {"frames_npy": npy}]})
    item = {"task_text": "t", "frames_npy": npy, "metadata": labelled}
    assert documented("ProgressBatchRequest", {"items": [item]})
    assert not documented("ProgressBatchRequest", {"items": [{**item, "stills": [png, png]}]})
