"""ResumableSampler and loader state: DistributedSampler's order, exact mid-epoch resume, exact resharding."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from ckptverify.errors import UsageError
from ckptverify.state.dataloader import (
    KIND_RESUMABLE_SAMPLER,
    KIND_STATEFUL_DATALOADER,
    WorkerSeeding,
    check_loader,
    find_resumable_sampler,
    loader_state,
    restore_loader,
)
from ckptverify.state.sampler import ResumableSampler, num_samples_per_replica

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

torchdata_sdl = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = torchdata_sdl.StatefulDataLoader


def _dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _global_order(
    n: int, replicas: int, *, epoch: int = 0, shuffle: bool = True, seed: int = 0, drop_last: bool = False
) -> list[int]:
    """The uninterrupted global order of one epoch: the ranks' lists interleaved."""
    lists = []
    for r in range(replicas):
        s = ResumableSampler(n, num_replicas=replicas, rank=r, shuffle=shuffle, seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        lists.append(list(s))
    return _interleave(lists)


def _interleave(lists: list[list[int]]) -> list[int]:
    assert len({len(x) for x in lists}) <= 1
    return [x for group in zip(*lists, strict=True) for x in group]


# ----------------------------------------------------------------------------------- DistributedSampler order


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_matches_distributed_sampler(shuffle: bool, drop_last: bool) -> None:
    for n, replicas, epoch, seed in itertools.product((0, 1, 5, 10, 16, 33), (1, 2, 3, 4, 7), (0, 3), (0, 9)):
        data = list(range(n))
        for rank in range(replicas):
            ref = DistributedSampler(
                data, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
            )
            ours = ResumableSampler(
                n, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
            )
            ref.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert list(ours) == list(ref), (n, replicas, rank, epoch)
            assert len(ours) == len(ref) == ours.num_samples


def test_defaults_without_process_group() -> None:
    s = ResumableSampler(10)
    assert (s.num_replicas, s.rank, s.shuffle, s.seed, s.drop_last) == (1, 0, True, 0, False)
    with pytest.raises(UsageError, match="out of range"):
        ResumableSampler(10, num_replicas=2, rank=2)
    with pytest.raises(UsageError):
        ResumableSampler(-1)


# ----------------------------------------------------------------------------------- resume through a DataLoader


def _run(
    loader: Any, sampler: ResumableSampler, epochs: range, *, stop: tuple[int, int] | None = None, tracked: bool = True
) -> tuple[list[list[int]], dict[str, Any] | None, int]:
    """Train-loop shape: set_epoch at the top of each epoch; snapshot the loader state after batch ``stop``."""
    out: list[list[int]] = []
    saved = None
    at = -1
    for epoch in epochs:
        sampler.set_epoch(epoch)
        batches = sampler.track(loader) if tracked else loader
        for step, batch in enumerate(batches, start=1):
            out.append(batch[0].tolist())
            if stop == (epoch, step):
                saved = copy.deepcopy(loader_state(loader))
                at = len(out)
    return out, saved, at


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_after_k_batches(num_workers: int) -> None:
    n, batch, replicas, rank = 45, 4, 2, 1
    ds = _dataset(n)

    def build() -> tuple[DataLoader, ResumableSampler]:
        s = ResumableSampler(n, num_replicas=replicas, rank=rank, seed=3)
        return DataLoader(ds, batch_size=batch, sampler=s, num_workers=num_workers), s

    per_epoch = -(-num_samples_per_replica(n, replicas, False) // batch)
    for stop in ((0, 3), (1, 1), (0, per_epoch)):  # mid-epoch, early in epoch 1, the end of epoch 0
        loader, sampler = build()
        full, saved, at = _run(loader, sampler, range(3), stop=stop)
        assert saved is not None and saved["kind"] == KIND_RESUMABLE_SAMPLER
        expected_position = min(stop[1] * batch, sampler.num_samples)
        assert saved["state"]["position"] == expected_position
        assert saved["state"]["epoch"] == stop[0]

        loader2, sampler2 = build()
        restore_loader(loader2, saved)
        resumed, _, _ = _run(loader2, sampler2, range(stop[0], 3))
        assert resumed == full[at:], stop


def test_untracked_single_process_loader_counts_consumed_batches() -> None:
    """With num_workers=0 nothing is drawn ahead, so the plain loop needs no tracking."""
    n, batch = 30, 4
    s = ResumableSampler(n, seed=1)
    loader = DataLoader(_dataset(n), batch_size=batch, sampler=s)
    full, saved, at = _run(loader, s, range(2), stop=(0, 5), tracked=False)
    assert saved is not None and saved["state"]["position"] == 20
    s2 = ResumableSampler(n, seed=1)
    loader2 = DataLoader(_dataset(n), batch_size=batch, sampler=s2)
    restore_loader(loader2, saved)
    resumed, _, _ = _run(loader2, s2, range(0, 2), tracked=False)
    assert resumed == full[at:]


def test_untracked_loader_with_workers_is_refused() -> None:
    s = ResumableSampler(40)
    loader = DataLoader(_dataset(40), batch_size=4, sampler=s, num_workers=2)
    assert loader_state(loader)["state"]["position"] == 0  # nothing drawn yet: fine
    it = iter(loader)
    next(it)
    assert s.drawn_this_pass > 4  # the workers were handed batches ahead of the loop
    with pytest.raises(UsageError, match="did not report consumption"):
        loader_state(loader)
    del it


def test_tracking_counts_consumed_not_prefetched() -> None:
    s = ResumableSampler(64)
    loader = DataLoader(_dataset(64), batch_size=4, sampler=s, num_workers=2, prefetch_factor=2)
    tracked = s.track(loader)
    for _ in range(2):
        next(tracked)
    assert s.position == 8
    assert s.drawn_ahead > 0
    assert loader_state(loader)["state"]["position"] == 8
    tracked.close()


def test_advance_and_track_misuse() -> None:
    s = ResumableSampler(10)
    with pytest.raises(UsageError, match="counted twice"):
        s.advance(1)
    it = iter(s)
    next(it)
    s.advance(1)
    with pytest.raises(UsageError, match="counted twice"):
        s.advance(1)
    with pytest.raises(UsageError, match="batch size"):
        s.track([[1]])
    with pytest.raises(UsageError, match="StatefulDataLoader"):
        s.track(StatefulDataLoader(_dataset(10), batch_size=2, sampler=s))


def test_set_epoch_semantics() -> None:
    s = ResumableSampler(12, seed=5)
    s.set_epoch(1)
    it = iter(s)
    first = [next(it) for _ in range(4)]
    sd = s.state_dict()
    assert sd["position"] == 4
    r = ResumableSampler(12, seed=5)
    r.load_state_dict(sd)
    r.set_epoch(1)  # the usual top-of-epoch call keeps the restored position
    assert len(r) == 8
    rest = list(r)
    assert first + rest == s.epoch_indices()
    assert list(r) == s.epoch_indices()  # a second pass of the same epoch starts over
    r.load_state_dict(sd)
    r.set_epoch(2)  # another epoch starts at 0
    assert r.position == 0
    assert len(list(r)) == 12


def test_load_refuses_different_configuration() -> None:
    sd = ResumableSampler(10, seed=1).state_dict()
    with pytest.raises(UsageError, match="dataset_len=10"):
        ResumableSampler(11, seed=1).load_state_dict(sd)
    with pytest.raises(UsageError, match="seed=1"):
        ResumableSampler(10, seed=2).load_state_dict(sd)
    with pytest.raises(UsageError, match="shuffle=True"):
        ResumableSampler(10, seed=1, shuffle=False).load_state_dict(sd)
    with pytest.raises(UsageError, match="version 2 is not supported"):
        ResumableSampler(10, seed=1).load_state_dict({**sd, "version": 2})
    with pytest.raises(UsageError, match="lacks"):
        ResumableSampler(10, seed=1).load_state_dict({k: v for k, v in sd.items() if k != "position"})
    two = ResumableSampler(10, num_replicas=2, rank=0, seed=1).state_dict()
    with pytest.raises(UsageError, match="belongs to rank 0"):
        ResumableSampler(10, num_replicas=2, rank=1, seed=1).load_state_dict(two)
    with pytest.raises(UsageError, match="inconsistent"):
        ResumableSampler(10, seed=1).load_state_dict({**sd, "position": 11})
    with pytest.raises(UsageError, match="sampler state must be a mapping, got list"):
        ResumableSampler(10, seed=1).load_state_dict([sd])  # type: ignore[arg-type]
    assert ResumableSampler(10, seed=1).last_batch() is None  # nothing handed out yet


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(0, 60),
    replicas=st.integers(1, 4),
    batch=st.integers(1, 8),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    loader_drop_last=st.booleans(),
    data=st.data(),
)
def test_resume_property(
    n: int, replicas: int, batch: int, shuffle: bool, drop_last: bool, loader_drop_last: bool, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, replicas - 1))
    ds = _dataset(n)

    def build() -> tuple[DataLoader, ResumableSampler]:
        s = ResumableSampler(n, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=7, drop_last=drop_last)
        return DataLoader(ds, batch_size=batch, sampler=s, drop_last=loader_drop_last), s

    loader, sampler = build()
    per_epoch = len(loader)
    k = data.draw(st.integers(0, per_epoch))
    epoch = data.draw(st.integers(0, 1))
    full, saved, at = _run(loader, sampler, range(2), stop=(epoch, k) if k else None)
    if k == 0:  # a checkpoint before the first batch of the run
        saved, at = {"kind": KIND_RESUMABLE_SAMPLER, "state": build()[1].state_dict()}, 0
        epoch = 0
    assert saved is not None
    assert saved["state"]["position"] == min(k * batch, sampler.num_samples)
    loader2, sampler2 = build()
    restore_loader(loader2, saved)
    resumed, _, _ = _run(loader2, sampler2, range(epoch, 2))
    assert resumed == full[at:]


# ----------------------------------------------------------------------------------- resharding


def _consume(sampler: ResumableSampler, k: int) -> dict[str, Any]:
    it = iter(sampler)
    for _ in range(k):
        next(it)
    return sampler.state_dict()


def _remaining(n: int, replicas: int, sd: dict[str, Any] | list[dict[str, Any]], **kw: Any) -> list[list[int]]:
    """What each of ``replicas`` new ranks yields after loading ``sd`` (or ``sd[r % len(sd)]``)."""
    states = sd if isinstance(sd, list) else [sd]
    out = []
    for r in range(replicas):
        s = ResumableSampler(n, num_replicas=replicas, rank=r, **kw)
        s.load_state_dict(states[r % len(states)])
        out.append(list(s))
    return out


def test_reshard_two_to_one() -> None:
    n = 24
    order = _global_order(n, 2, seed=4)
    for per_rank in (0, 3, 9, 12):
        states = [_consume(ResumableSampler(n, num_replicas=2, rank=r, seed=4), per_rank) for r in range(2)]
        for sd in states:  # either rank's state carries the same global position
            (rest,) = _remaining(n, 1, sd, seed=4)
            assert rest == order[2 * per_rank :]


def test_reshard_one_to_two() -> None:
    n = 24
    order = _global_order(n, 1, seed=4)
    for consumed in (0, 4, 10, 24):
        sd = _consume(ResumableSampler(n, seed=4), consumed)
        rest = _remaining(n, 2, sd, seed=4)
        assert _interleave(rest) == order[consumed:]
        resharded = ResumableSampler(n, num_replicas=2, rank=1, seed=4)
        resharded.load_state_dict(sd)
        assert resharded.position == consumed // 2


def test_reshard_padding_changes_only_repeats() -> None:
    """n=10 on 4 replicas is padded to 12, on 2 replicas not at all: no unconsumed sample is lost."""
    n = 10
    old = _global_order(n, 4)
    states = [_consume(ResumableSampler(n, num_replicas=4, rank=r), 1) for r in range(4)]
    merged = _interleave(_remaining(n, 2, states[0]))
    assert merged == old[4:10]
    assert set(old[4:]) <= set(merged) | set(old[:4])


def test_reshard_refused_when_not_exact() -> None:
    sd = _consume(ResumableSampler(24, seed=4), 5)
    with pytest.raises(UsageError, match=r"5 samples, 5 globally, which is not divisible by 2"):
        ResumableSampler(24, num_replicas=2, rank=0, seed=4).load_state_dict(sd)
    sd = _consume(ResumableSampler(24, num_replicas=2, rank=0, seed=4), 4)
    with pytest.raises(UsageError, match=r"from 2 to 3 replicas.*8 globally"):
        ResumableSampler(24, num_replicas=3, rank=0, seed=4).load_state_dict(sd)
    # drop_last: 10 samples on 2 replicas are all used, on 4 replicas only 8 would be.
    sd = _consume(ResumableSampler(10, num_replicas=2, rank=0, drop_last=True), 2)
    with pytest.raises(UsageError, match="drop_last"):
        ResumableSampler(10, num_replicas=4, rank=0, drop_last=True).load_state_dict(sd)


def test_reshard_at_epoch_end() -> None:
    sd = _consume(ResumableSampler(10, num_replicas=3, rank=0), 4)  # 4 of 4: the epoch is done
    rest = _remaining(10, 2, sd)
    assert rest == [[], []]


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(0, 50),
    old=st.integers(1, 4),
    new=st.integers(1, 4),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    data=st.data(),
)
def test_reshard_property(n: int, old: int, new: int, shuffle: bool, drop_last: bool, data: st.DataObject) -> None:
    """Resharding either continues the global order exactly or refuses; it never skips a sample."""
    kw = {"shuffle": shuffle, "drop_last": drop_last, "seed": 2}
    old_ns = num_samples_per_replica(n, old, drop_last)
    position = data.draw(st.integers(0, old_ns))
    states = [_consume(ResumableSampler(n, num_replicas=old, rank=r, **kw), position) for r in range(old)]
    g_old = _global_order(n, old, **kw)
    g_new = _global_order(n, new, **kw)
    consumed = position * old
    try:
        rest = _remaining(n, new, states, **kw)
    except UsageError:
        assert old != new and position != old_ns
        assert consumed % new != 0 or (drop_last and len(g_old) != len(g_new))
        return
    if position == old_ns:
        assert all(r == [] for r in rest)
        return
    merged = _interleave(rest)
    assert g_new[:consumed] == g_old[:consumed]  # the new order agrees on what was consumed
    assert merged == g_new[consumed:]
    assert set(g_old[consumed:]) <= set(merged) | set(g_old[:consumed])  # nothing unconsumed is skipped
    if drop_last:
        assert merged == g_old[consumed:]


# ----------------------------------------------------------------------------------- StatefulDataLoader


def _sdl(n: int, batch: int, workers: int, **kw: Any) -> StatefulDataLoader:
    if "sampler" not in kw:
        kw = {"shuffle": True, "generator": torch.Generator().manual_seed(5), **kw}
    return StatefulDataLoader(_dataset(n), batch_size=batch, num_workers=workers, **kw)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resumes_exact_next_batches(num_workers: int, tmp_path: Path) -> None:
    n, batch, k = 50, 4, 5
    full = [b[0].tolist() for b in _sdl(n, batch, num_workers)]
    loader = _sdl(n, batch, num_workers)
    it = iter(loader)
    head = [next(it)[0].tolist() for _ in range(k)]
    assert head == full[:k]
    state = copy.deepcopy(loader_state(loader))
    assert state["kind"] == KIND_STATEFUL_DATALOADER
    tail = [b[0].tolist() for b in it]
    assert tail == full[k:]

    fresh = _sdl(n, batch, num_workers)
    restore_loader(fresh, state)
    assert [b[0].tolist() for b in fresh] == full[k:]

    # Through DCP, loaded into the state of a freshly built loader as template.
    dcp.save({"loader": state}, checkpoint_id=str(tmp_path))
    fresh = _sdl(n, batch, num_workers)
    template = {"loader": loader_state(fresh)}
    dcp.load(template, checkpoint_id=str(tmp_path))
    restore_loader(fresh, template["loader"])
    assert [b[0].tolist() for b in fresh] == full[k:]


def test_stateful_dataloader_with_resumable_sampler_and_workers() -> None:
    """StatefulDataLoader snapshots the sampler when it dispatches a batch, so no tracking is needed."""
    n, batch, k = 50, 3, 4

    def build() -> StatefulDataLoader:
        return _sdl(n, batch, 2, sampler=ResumableSampler(n, num_replicas=2, rank=1, seed=8))

    full = [b[0].tolist() for b in build()]
    loader = build()
    it = iter(loader)
    for _ in range(k):
        next(it)
    state = copy.deepcopy(loader_state(loader))
    del it
    fresh = build()
    restore_loader(fresh, state)
    assert [b[0].tolist() for b in fresh] == full[k:]


def test_loader_dispatch() -> None:
    s = ResumableSampler(20)
    plain = DataLoader(_dataset(20), batch_size=4, sampler=s)
    assert find_resumable_sampler(plain) is s
    via_batch_sampler = DataLoader(_dataset(20), batch_sampler=BatchSampler(s, 4, drop_last=False))
    assert find_resumable_sampler(via_batch_sampler) is s
    state = loader_state(via_batch_sampler)
    assert state == {"kind": KIND_RESUMABLE_SAMPLER, "state": s.state_dict()}
    restore_loader(via_batch_sampler, state)

    unsupported = DataLoader(_dataset(20), batch_size=4, shuffle=True)
    with pytest.raises(UsageError, match="supported loaders are torchdata's StatefulDataLoader"):
        loader_state(unsupported)
    with pytest.raises(UsageError, match="supported loaders"):
        restore_loader(unsupported, state)
    with pytest.raises(UsageError, match="cannot be restored"):
        restore_loader(_sdl(20, 4, 0), state)
    with pytest.raises(UsageError, match="'kind' and 'state'"):
        restore_loader(plain, {"position": 3})

    tracked_sdl = _sdl(20, 4, 0, sampler=ResumableSampler(20))
    find_resumable_sampler(tracked_sdl)._tracking = True  # as if someone had tracked it
    with pytest.raises(UsageError, match="iterate it directly"):
        loader_state(tracked_sdl)


def test_worker_seeding_is_installed_only_where_workers_fetch_batches() -> None:
    """Without automatic batching the workers fetch single samples: there is no batch to seed, nothing installed."""
    single = ResumableSampler(8, shuffle=False)
    loader = DataLoader(list(range(8)), batch_size=None, sampler=single, num_workers=2)
    check_loader(loader)
    assert loader.worker_init_fn is None and not single._tag
    batched = ResumableSampler(8, shuffle=False)
    loader = DataLoader(list(range(8)), batch_size=2, sampler=batched, num_workers=2)
    check_loader(loader)
    assert isinstance(loader.worker_init_fn, WorkerSeeding) and batched._tag
