"""The chat body as sent (proxy.prompting.layouts.encode_body): the media URLs are spliced in after JSON
encoding, and the bytes must still be exactly the JSON of the body, whatever the text holds."""

from __future__ import annotations

import base64
import json

from hypothesis import given
from hypothesis import strategies as st

from proxy.prompting.layouts import encode_body

b64 = st.binary(min_size=0, max_size=64).map(lambda b: base64.b64encode(b).decode())
text = st.text(max_size=80)  # any unicode: quotes, backslashes, NULs, surrogates' neighbours
uuid = st.one_of(st.none(), st.text(alphabet="0123456789abcdef", min_size=64, max_size=64), text)


def _named(part: dict, name: str | None) -> dict:
    """A media part with vLLM's `uuid` beside its data (backend key media_uuids), or without."""
    return part if name is None else {**part, "uuid": name}


part = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, text),
    st.builds(lambda d, u: _named({"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + d}}, u),
              b64, uuid),
    st.builds(lambda ds, u: _named({"type": "video_url",
                                    "video_url": {"url": "data:video/jpeg;base64," + ",".join(ds)}}, u),
              st.lists(b64, min_size=1, max_size=4), uuid),
)


odd_url = st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, text)  # not base64: escaped


@given(system=st.one_of(st.none(), text), parts=st.lists(st.one_of(part, odd_url), max_size=6),
       temperature=st.floats(0, 2))
def test_the_spliced_body_is_the_json_of_the_body(system, parts, temperature):
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": parts}]
    body = {"model": "m", "messages": messages, "n": 1, "stream": False}
    assert json.loads(encode_body(body)) == body
    assert json.loads(encode_body(body, {"temperature": temperature})) == {**body, "temperature": temperature}
