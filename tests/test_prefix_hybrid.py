"""The prefix store on hybrid caches (recurrent layers beside attention): an entry serves only
the lengths where it holds the recurrent state (its restore points), so a hit counts up to the
deepest restore point at or below the token match."""

from __future__ import annotations

from numbakv.prefix.index import BlockIndex, Entry
from numbakv.prefix.keys import token_bytes


def _entry(index, root, tokens, tier="cells", floor=0, restore=None):
    e = Entry(tier, root, index.insert_path(root, token_bytes(tokens)), floor=floor,
              restore=restore)
    index.add(e)
    return e


def test_index_serves_the_deepest_restore_point_at_or_below_the_token_match():
    idx = BlockIndex(4)
    root = b"r" * 16
    long = _entry(idx, root, list(range(20)), restore=(6, 13, 20))
    assert idx.match(root, token_bytes(list(range(20)) + [5])).n == 20
    m = idx.match(root, token_bytes(list(range(17)) + [0, 0]))
    assert (m.n, m.entry, m.tokens_matched) == (13, long, 17)     # token match 17 -> point 13
    assert idx.match(root, token_bytes(list(range(12)))).n == 6
    assert idx.match(root, token_bytes(list(range(5)))).n == 0     # below the first point
    # another entry with a deeper point below the match wins, whatever its tier
    short = _entry(idx, root, list(range(16)), tier="host", restore=(16,))
    m = idx.match(root, token_bytes(list(range(18))))
    assert (m.n, m.entry) == (16, short)
    # a point equal to the match: the fast path; lower tier rank first, then the shorter
    m = idx.match(root, token_bytes(list(range(13))))
    assert (m.n, m.entry) == (13, long)
    assert short.servable(15) == 0 and long.servable(19) == 13 and long.servable(100) == 20


def test_index_restore_points_and_window_floor_together():
    idx = BlockIndex(4)
    root = b"r" * 16
    e = _entry(idx, root, list(range(20)), floor=10, restore=(4, 8, 12, 20))
    assert e.servable(11) == 0            # point 8 is below the window floor
    assert idx.match(root, token_bytes(list(range(15)))).n == 12
    assert idx.match(root, token_bytes(list(range(11)))).n == 0
