"""swarm.stage.admission, pure: the open frame's checks, the bytes a session reserves, the
--kv-budget-mb decision and the reservations of opens in progress, as plain tables of cases."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from swarm.errors import ConfigError, ContextOverflow, ProtocolError
from swarm.frames import Open
from swarm.ranges import LayerRange
from swarm.stage.admission import OpenPlace, Reservations, Verdict, decide, kv_need, open_links, open_place

ME = "12D3KooWSelf"
NEXT = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWNext"


# ---- decide: need, held, budget, cached -> verdict ---------------------------------------------

@pytest.mark.parametrize("need, held, budget, cached, verdict", [
    (10, 20, None, None, Verdict(admit=True)),  # no --kv-budget-mb: everything fits
    (10, 10**9, None, 500, Verdict(admit=True)),  # ... whatever is held or cached
    (101, 0, 100, None, Verdict(admit=False, too_big=True)),  # more than the whole budget alone
    (101, 0, 100, 0, Verdict(admit=False, too_big=True)),
    (100, 0, 100, None, Verdict(admit=True)),  # exactly the whole budget
    (10, 20, 100, None, Verdict(admit=True)),
    (10, 90, 100, None, Verdict(admit=True)),  # held + need == budget: fits
    (10, 91, 100, None, Verdict(admit=False)),  # busy: retry when a session ends
    (10, 20, 100, 70, Verdict(admit=True)),  # the prefix cache fits beside it: left alone
    (10, 20, 100, 80, Verdict(admit=True, evict_to=70)),  # cold prefixes make room
    (10, 90, 100, 5, Verdict(admit=True, evict_to=0)),
    (10, 95, 100, 0, Verdict(admit=False, evict_to=0)),  # busy: the cache is emptied all the same
    (10, 95, 100, None, Verdict(admit=False)),  # no prefix cache: nothing to evict
])
def test_decide(need, held, budget, cached, verdict):
    assert decide(need, held, budget, cached) == verdict


# ---- kv_need: the KV cache and the log of hidden states sent on ---------------------------------

@pytest.mark.parametrize("max_len, per_pos, row_bytes, tail, heal_log_mb, expected", [
    (64, 100, 8, True, None, (6400, 0)),  # the tail sends token ids: no log
    (64, 100, 8, True, 1.0, (6400, 0)),
    (64, 100, 8, False, None, (64 * 108, 64)),  # every position sent is kept
    (64, 100, 8, False, 0.0, (6400, 0)),  # --heal-log-mb 0: none kept
    (64, 100, 2**14, False, 0.5, (6400 + 32 * 2**14, 32)),  # the log holds what 0.5 MiB holds
    (16, 100, 2**14, False, 0.5, (1600 + 16 * 2**14, 16)),  # never more than max_len positions
])
def test_kv_need(max_len, per_pos, row_bytes, tail, heal_log_mb, expected):
    assert kv_need(max_len, per_pos, row_bytes, tail, heal_log_mb) == expected


# ---- open_place and open_links: where the open puts the session --------------------------------

class _Block:
    """What open_place reads of a LayerBlock holding layers [0, 4) of a 4-layer model."""

    num_layers = 4
    layer_range = LayerRange(0, 4)

    def check_span(self, span):
        if span is None:
            return self.layer_range
        if span.start < 0 or span.end > 4:
            raise ConfigError(f"layers {span} are not held here")
        return span


def _open(**fields) -> Open:
    return Open(**{"session": "s", "next": None, "max_len": 0, "sig": "", **fields})


@pytest.mark.parametrize("fields, place", [
    ({}, OpenPlace(LayerRange(0, 4), head=True, tail=True)),
    ({"layers": [0, 2]}, OpenPlace(LayerRange(0, 2), head=True, tail=False)),
    ({"layers": [2, 4], "prev": "12D3KooWPrev"}, OpenPlace(LayerRange(2, 4), head=False, tail=True)),
    ({"layers": [1, 3], "prev": "12D3KooWPrev"}, OpenPlace(LayerRange(1, 3), head=False, tail=False)),
])
def test_open_place(fields, place):
    assert open_place(_open(**fields), _Block()) == place


@pytest.mark.parametrize("fields, reason", [
    ({"prev": "12D3KooWPrev"}, "is the head"),  # the head's input comes from the coordinator
    ({"layers": [2, 4]}, "needs 'prev'"),
    ({"layers": [2, 6], "prev": "12D3KooWPrev"}, "open frame: layers"),
])
def test_open_place_refuses(fields, reason):
    with pytest.raises(ProtocolError, match=reason):
        open_place(_open(**fields), _Block())


HEAD = OpenPlace(LayerRange(0, 2), head=True, tail=False)
TAIL = OpenPlace(LayerRange(2, 4), head=False, tail=True)


@pytest.mark.parametrize("fields, place, max_len", [
    ({"next": NEXT}, HEAD, 128),  # max_len 0: the stage's whole context
    ({"next": NEXT, "max_len": 64}, HEAD, 64),
    ({"max_len": 128}, TAIL, 128),
    ({"shadow": True}, HEAD, 128),  # a shadow sends nothing on
    ({"next": NEXT, "mirror": "/ip4/127.0.0.1/tcp/2/p2p/12D3KooWShadow", "mirror_until": 4}, HEAD, 128),
])
def test_open_links(fields, place, max_len):
    assert open_links(_open(**fields), place, ME, 128) == max_len


@pytest.mark.parametrize("fields, place, error, reason", [
    ({"next": NEXT}, TAIL, ProtocolError, "is the tail"),
    ({"next": f"/ip4/127.0.0.1/tcp/1/p2p/{ME}"}, HEAD, ProtocolError, "this stage itself"),
    ({"next": NEXT, "shadow": True}, HEAD, ProtocolError, "a shadow sends nothing on"),
    ({}, HEAD, ProtocolError, "needs a successor"),
    ({"next": NEXT, "mirror": NEXT, "mirror_until": 2}, HEAD, ProtocolError, "cannot mirror"),  # not past it
    ({"next": NEXT, "mirror": "/ip4/127.0.0.1/tcp/2/p2p/", "mirror_until": 4}, HEAD, ProtocolError,
     "cannot mirror"),  # no PeerId
    ({"next": NEXT, "mirror": f"/ip4/127.0.0.1/tcp/2/p2p/{ME}", "mirror_until": 4}, HEAD, ProtocolError,
     "cannot mirror"),  # itself
    ({"mirror": NEXT, "mirror_until": 4}, TAIL, ProtocolError, "cannot mirror"),  # nothing after the tail
    ({"max_len": 129}, TAIL, ContextOverflow, "maximum context is 128"),
])
def test_open_links_refuses(fields, place, error, reason):
    with pytest.raises(error, match=reason):
        open_links(_open(**fields), place, ME, 128)


# ---- Reservations: live sessions and opens in progress ------------------------------------------

def test_reservations_count_sessions_and_opens_in_progress():
    sessions = {sid: SimpleNamespace(session_id=sid, reserved=n) for sid, n in (("a", 10), ("b", 20))}
    res = Reservations(sessions)
    assert (res.held(), res.held(besides="a"), res.holders(), res.holders(besides="a")) == (30, 20, 2, 1)
    with res.opening_session("c", 5):
        assert (res.held(), res.held(besides="c"), res.holders()) == (35, 30, 3)
        sessions["c"] = SimpleNamespace(session_id="c", reserved=5)  # recorded while still opening
        assert res.held() == 40 and res.held(besides="c") == 30
    assert res.opening == {} and res.held() == 35


def test_an_open_that_fails_releases_its_bytes():
    res = Reservations({})
    with pytest.raises(RuntimeError), res.opening_session("a", 7):
        assert res.held() == 7
        raise RuntimeError("the successor could not be dialed")
    assert res.opening == {} and res.held() == 0
