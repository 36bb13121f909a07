"""Bucket table: the default rule, user lists, and the size -> bucket lookup
against a plain `min(b for b in buckets if b >= n)` reference."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphs.replay import BucketTable, default_buckets


def reference_bucket(buckets: tuple[int, ...], num_reqs: int) -> int | None:
    fitting = [b for b in buckets if b >= num_reqs]
    return min(fitting) if fitting else None


def test_default_shape() -> None:
    assert BucketTable(64).buckets == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert BucketTable(256).buckets == (
        1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64,
        80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256,
    )
    assert BucketTable(1).buckets == (1,)
    assert BucketTable(3).buckets == (1, 2, 3)


def test_max_num_reqs_outside_the_rule_is_still_a_bucket() -> None:
    # nano-vllm's pitfall: with max_num_seqs = 100 not in its list, a batch of
    # 97..100 requests found no bucket (StopIteration).
    table = BucketTable(100)
    assert table.buckets[-3:] == (80, 96, 100)
    assert table.largest == 100
    assert table.bucket_for(97) == 100
    assert table.bucket_for(100) == 100
    assert table.bucket_for(101) is None


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 700))
def test_default_rule_and_lookup(max_num_reqs: int) -> None:
    table = BucketTable(max_num_reqs)
    buckets = table.buckets
    assert buckets == default_buckets(max_num_reqs)
    assert list(buckets) == sorted(set(buckets))
    assert buckets[-1] == max_num_reqs == table.largest
    for b in buckets[:-1]:
        assert b in (1, 2, 4, 8) or (b <= 64 and b % 8 == 0) or (b > 64 and b % 16 == 0), b
    # Every step of the rule below the cap is present.
    expected_below = [b for b in (1, 2, 4, 8, *range(16, 65, 8), *range(80, 701, 16)) if b < max_num_reqs]
    assert list(buckets[:-1]) == expected_below
    for n in range(1, max_num_reqs + 3):
        assert table.bucket_for(n) == reference_bucket(buckets, n), n
    assert list(table) == list(buckets)
    assert len(table) == len(buckets)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_user_list_lookup(data: st.DataObject) -> None:
    max_num_reqs = data.draw(st.integers(1, 300))
    sizes = sorted(data.draw(st.sets(st.integers(1, max_num_reqs), max_size=20)))
    table = BucketTable(max_num_reqs, sizes)
    expected = tuple(sizes) if sizes and sizes[-1] == max_num_reqs else (*sizes, max_num_reqs)
    assert table.buckets == expected
    for n in range(1, max_num_reqs + 2):
        assert table.bucket_for(n) == reference_bucket(expected, n), n


def test_user_list_gets_max_num_reqs_appended() -> None:
    assert BucketTable(10, [1, 3]).buckets == (1, 3, 10)
    assert BucketTable(10, [1, 3, 10]).buckets == (1, 3, 10)
    assert BucketTable(10, []).buckets == (10,)
    assert BucketTable(10, (2, 5)).bucket_for(1) == 2


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ([1, 4, 2], r"buckets\[2\] = 2: .*sorted"),
        ([1, 2, 2], r"buckets\[2\] = 2: .*unique"),
        ([0, 2], r"buckets\[0\] = 0: .*>= 1"),
        ([-4], r"buckets\[0\] = -4: .*>= 1"),
        ([1, 2.0], r"buckets\[1\] = 2.0: .*ints"),
        ([True, 2], r"buckets\[0\] = True: .*ints"),
        ([1, "8"], r"buckets\[1\] = '8': .*ints"),
        ([1, 32], r"buckets\[1\] = 32: exceeds max_num_reqs = 16"),
    ],
)
def test_user_list_validation(sizes: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BucketTable(16, sizes)


@pytest.mark.parametrize("max_num_reqs", [0, -1, 2.5, True, None])
def test_max_num_reqs_validation(max_num_reqs: object) -> None:
    with pytest.raises(ValueError, match="max_num_reqs"):
        BucketTable(max_num_reqs)  # type: ignore[arg-type]


@pytest.mark.parametrize("num_reqs", [0, -3])
def test_bucket_for_needs_a_request(num_reqs: int) -> None:
    with pytest.raises(ValueError, match=f"num_reqs = {num_reqs}"):
        BucketTable(8).bucket_for(num_reqs)


def test_table_is_frozen_and_lookup_read_only() -> None:
    table = BucketTable(8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.max_num_reqs = 16  # type: ignore[misc]
    with pytest.raises(ValueError):
        table._lookup[3] = 1
    assert 4 in table and 5 not in table
    assert BucketTable(8).buckets == BucketTable(8, [1, 2, 4, 8]).buckets
