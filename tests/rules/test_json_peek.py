"""proxy.protocol.json_peek reads top-level fields without parsing the rest: it must agree with
json.loads on every object, however it is spelled, and refuse what is not one object."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.protocol.json_peek import NotJsonObject, peek_fields, splice

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                    st.text(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
keys = st.one_of(st.sampled_from(["model", "stream", 'mo"del', "mod\\el", "é"]), st.text(max_size=8))
objects = st.dictionaries(keys, values, max_size=8)
spellings = st.sampled_from([{"separators": (",", ":")}, {}, {"indent": 2}, {"ensure_ascii": False},
                             {"indent": "\t", "ensure_ascii": False}])


@given(obj=objects, spelling=spellings, wanted=st.sets(keys, max_size=3))
def test_every_wanted_field_is_what_json_loads_reads(obj, spelling, wanted):
    raw = json.dumps(obj, **spelling).encode()
    found = peek_fields(raw, frozenset(wanted))
    assert set(found) == set(wanted) & set(obj)
    for key, field in found.items():
        assert json.loads(raw[field.start:field.end]) == obj[key]  # the span is the value, whole
        if not isinstance(obj[key], (dict, list)):
            assert field.value == obj[key]


@given(obj=objects, spelling=spellings, key=keys, replacement=scalars)
def test_splicing_a_field_changes_that_field_only(obj, spelling, key, replacement):
    obj = {**obj, key: "alias"}
    raw = json.dumps(obj, **spelling).encode()
    field = peek_fields(raw, frozenset({key}))[key]
    assert json.loads(splice(raw, field, replacement)) == {**obj, key: replacement}


def test_a_leading_utf8_bom_is_read_as_json_loads_reads_it():
    raw = b"\xef\xbb\xbf" + json.dumps({"model": "m"}).encode()
    assert peek_fields(raw, frozenset({"model"}))["model"].value == json.loads(raw)["model"] == "m"


def test_quotes_and_backslash_runs_inside_strings_do_not_end_them():
    raw = json.dumps({"messages": ['a \\" b', "\\\\", 'end"quote\\'], "model": "m", "x": "\\"}).encode()
    assert peek_fields(raw, frozenset({"model"}))["model"].value == "m"
    escaped_key = b'{"mod\\u0065l": "m2", "stream": true}'
    found = peek_fields(escaped_key, frozenset({"model", "stream"}))
    assert found["model"].value == "m2" and found["stream"].value is True


@pytest.mark.parametrize("raw, reason", [
    (b"", "not a JSON object"),
    (b"[1, 2]", "not a JSON object"),
    (b'"model"', "not a JSON object"),
    (b'{"model": "m"', "expected ',' or '}'"),
    (b'{"model": "m", "messages": [1, 2}', "does not match"),
    (b'{"messages": [{"a": 1}', "balance"),
    (b'{"model": "m}', "never ends"),
    (b'{"model": "a", "model": "b"}', "given twice"),
    (b'{"model": "m"} {}', "extra data"),
    (b'{"model" "m"}', "expected ':'"),
    (b'{model: "m"}', "expected a key"),
    (b'{"model": nope}', "no valid JSON value"),
    (b'{"\\q": 1, "model": "m"}', "a key is not a valid JSON string"),  # a bad escape (json.loads refuses it)
    (b'{"\xff": 1, "model": "m"}', "a key is not a valid JSON string"),  # not UTF-8
])
def test_what_is_not_one_object_is_refused_with_a_reason(raw, reason):
    with pytest.raises(NotJsonObject, match=reason):
        peek_fields(raw, frozenset({"model"}))
