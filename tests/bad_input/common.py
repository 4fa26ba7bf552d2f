"""What the bad-input tests share: a valid body to spoil, and the check of a refusal."""

from __future__ import annotations

from tests.fakes.episodes import episode_frames, npy_b64

SMALL = npy_b64(episode_frames(4, 64, 64))
BASE = {"task_text": "put the bowl on the plate", "frames_npy": SMALL}
DROP = object()  # remove the key from BASE


def expect(response, status: int, code: str | None = None, field: str | None = None,
           mentions: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json", response.text
    error = response.json()["error"]
    assert code is None or error["code"] == code, error
    assert error["message"] and error["request_id"], error
    if field is not None:
        assert error.get("field") == field, error
    if mentions is not None:
        assert mentions.lower() in error["message"].lower(), error
    return error
