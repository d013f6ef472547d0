"""A request's TokenDance options: where a client may put them (srt/request.client_options)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sglang_tokendance.core.segments import SegmentError
from sglang_tokendance.srt.request import RequestOptions, client_options, strip_router_carrier

OPTIONS = {"round": "r1", "round_size": 4}


@pytest.mark.parametrize("body", [
    {"tokendance": OPTIONS},
    {"custom_labels": {"team": "a", "tokendance": json.dumps(OPTIONS)}},
    {"metadata": {"tokendance": json.dumps(OPTIONS)}},
])
def test_each_carrier_gives_the_same_options(body):
    assert client_options(body) == OPTIONS
    assert RequestOptions.from_client(client_options(body), mirror_storage=False).round.size == 4


@pytest.mark.parametrize("body", [None, [], {}, {"custom_labels": {"team": "a"}}, {"metadata": None}])
def test_no_options(body):
    assert client_options(body) is None


@pytest.mark.parametrize("body, message", [
    ({"custom_labels": {"tokendance": "{round"}}, "JSON text"),
    ({"metadata": {"tokendance": "[1, 2]"}}, "JSON text"),
    ({"metadata": {"tokendance": {"round": "r1"}}}, "JSON text"),  # an object, not its text
    ({"tokendance": OPTIONS, "metadata": {"tokendance": json.dumps(OPTIONS)}}, "given twice"),
    ({"custom_labels": {"tokendance": "{}"}, "metadata": {"tokendance": "{}"}}, "given twice"),
])
def test_bad_carriers_are_errors(body, message):
    with pytest.raises(SegmentError, match=message):
        client_options(body)


def test_the_label_is_taken_out_and_other_labels_kept():
    obj = SimpleNamespace(custom_labels={"team": "a", "tokendance": "{}"})
    strip_router_carrier(obj)
    assert obj.custom_labels == {"team": "a"}
    alone = SimpleNamespace(custom_labels={"tokendance": "{}"})
    strip_router_carrier(alone)
    assert alone.custom_labels is None


@pytest.mark.parametrize("hint", [{"pin_seconds": 30}, {"retain_seconds": 0.5}, {"release": True}])
def test_a_hint_is_carried_to_the_scheduler(hint):
    options = RequestOptions.from_client(hint, mirror_storage=False)
    carried = RequestOptions.carried_by({"tokendance": json.dumps(options.payload())})
    assert carried.hint == options.hint and carried.hint.kind == next(iter(hint)).removesuffix("_seconds")
    assert RequestOptions.from_client({"release": False}, mirror_storage=False).hint is None
    ended = RequestOptions.from_client({"simulation": "s1", "end_simulation": True, **hint}, mirror_storage=False)
    carried = RequestOptions.carried_by({"tokendance": json.dumps(ended.payload())})
    assert (carried.simulation, carried.end_simulation, carried.hint) == ("s1", True, options.hint)


@pytest.mark.parametrize("hint, message", [
    ({"pin_seconds": 10, "retain_seconds": 10}, "at most one"),
    ({"retain_seconds": 10, "release": True}, "at most one"),
    ({"pin_seconds": 0}, "pin_seconds"), ({"retain_seconds": -1}, "retain_seconds"),
    ({"pin_seconds": "60"}, "pin_seconds"), ({"pin_seconds": True}, "pin_seconds"),
    ({"retain_seconds": 601}, r"\(0, 600\]"), ({"pin_seconds": float("nan")}, "pin_seconds"),
    ({"release": "yes"}, "release"), ({"pin": 10}, "must be an object"),
    ({"end_simulation": True}, "needs `tokendance.simulation`"), ({"simulation": ""}, "simulation"),
    ({"simulation": "s", "end_simulation": "yes"}, "end_simulation"),
])
def test_bad_hints_are_errors(hint, message):
    with pytest.raises(SegmentError, match=message):
        RequestOptions.from_client(hint, mirror_storage=False)
    assert RequestOptions.from_client({"retain_seconds": 601}, False, max_hint_seconds=900).hint.seconds == 601
