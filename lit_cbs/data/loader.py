"""``GlobalOrderLoader``: micro-batches cut from one global sample order, so that the micro-batch can
change between any two optimizer steps and a run resumes exactly on any number of ranks.

The order. Each epoch is one permutation of the dataset's samples, seeded by ``(seed, epoch)``
alone: it does not depend on the number of ranks, the micro-batch or the accumulation. An optimizer
step with a global batch of B samples trains on the next B samples of that order.

The split. From the position P where the current micro-batch size m took effect, the samples are
dealt to the W data-parallel ranks in runs of m: micro-batch k of rank r holds positions
``P + (k W + r) m`` to ``P + (k W + r + 1) m - 1``. A step of N micro-batches per rank therefore takes,
over all ranks, exactly the positions ``[P', P' + N m W)`` that follow the previous step, whatever
m, N and W are, as long as ``B = m N W``.

The tail. Where fewer than m W samples are left, the epoch's last round deals them to the ranks as
evenly as can be, in rank order: each rank takes a run of t // W samples (t: the samples left), and
ranks 0 to t % W - 1 one more. Every sample of every epoch thus trains exactly once, whatever m, the
accumulation and W, and every rank yields the same number of micro-batches (DDP and FSDP run
collectives in every backward). A rank whose share is empty (fewer samples left than ranks, which only
a dataset whose size is no multiple of W leaves) yields a micro-batch of zero samples: the batch of
one sample with every tensor (and numpy array) cut to zero rows along dim 0, so that it still runs
the forward and backward passes the other ranks' collectives wait for. ``BatchAccounting`` checks,
before training, that the module's ``training_step`` gives such a batch a finite loss.

So the data position is one number, the samples consumed so far this epoch over all ranks
(``position``, in the checkpoint). Changing m at a step boundary (``batch_size = ...``), or
resuming on another number of ranks, regroups the samples from that position on: none is skipped or
repeated, and every step still trains on the same samples as a run that never changed.

Lightning's fit loop reads the loader as it reads a ``DataLoader``: ``len()`` (micro-batches this rank
yields this epoch) keeps it from fetching ahead, so a new ``batch_size`` applies from the very next
micro-batch; ``state_dict``/``load_state_dict`` carry the position through checkpoints; and
``sampler.set_epoch`` (``sampler`` is the loader itself) moves it to the next epoch's order.
Samples are read with a torch ``DataLoader`` (workers, ``collate_fn``, ``pin_memory``) over the
index runs, restarted from the current position whenever the micro-batch changes; its worker seeds
come from a generator of its own, so the global random streams are never drawn from.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from lit_cbs._internals import tree_map
from lit_cbs.errors import LitCBSConfigError, positive_int

__all__ = ["GlobalOrderLoader"]


def global_sample_count(dataset: Any) -> int:
    """Samples in the whole dataset, over all ranks. A litdata ``StreamingDataset`` reports its own rank's
    share as ``len()``; its ``region_of_interest`` (item ranges per chunk) gives the whole."""
    regions = getattr(dataset, "region_of_interest", None)
    if regions:
        return int(sum(end - start for start, end in regions))
    return len(dataset)


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The epoch's global order of sample indices: a permutation seeded by (seed, epoch) alone, or 0..n-1."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(num_samples).astype(np.int64, copy=False)


def round_share(round_samples: int, rank: int, world: int) -> tuple[int, int]:
    """(offset, samples) of rank ``rank``'s run in a round of ``round_samples`` samples dealt to ``world``
    ranks: runs in rank order, as equal as can be, the first ``round_samples % world`` ranks one sample more."""
    base, extra = divmod(round_samples, world)
    return rank * base + min(rank, extra), base + (rank < extra)


def rank_micro_batches(
    order: np.ndarray, start: int, micro_batch_size: int, rank: int, world: int
) -> Iterator[list[int]]:
    """The sample indices of each micro-batch rank ``rank`` of ``world`` reads from ``start`` on: rounds of
    ``micro_batch_size`` samples per rank, dealt to the ranks in turn, up to the end of ``order``; the last
    round, where fewer are left, by ``round_share`` (a rank's share may be empty: [])."""
    stride = micro_batch_size * world
    for base in range(start, len(order), stride):
        offset, samples = round_share(min(stride, len(order) - base), rank, world)
        yield order[base + offset : base + offset + samples].tolist()


def zero_rows(batch: Any) -> Any:
    """``batch`` with every tensor and numpy array cut to its first zero rows (dim 0): a micro-batch of no
    sample with the structure, dtypes and trailing shapes of a real one."""
    return tree_map(lambda leaf: leaf[:0] if isinstance(leaf, (torch.Tensor, np.ndarray)) else leaf, batch)


class _ByIndex(Dataset):
    """A dataset that is iterable-style to torch (litdata's StreamingDataset) read by index, which a
    DataLoader with a batch sampler requires."""

    def __init__(self, dataset: Any, length: int):
        self.dataset, self.length = dataset, length

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __len__(self) -> int:
        return self.length


class _IndexRuns:
    """A batch sampler over fixed index runs (a torch DataLoader takes its index lists from it)."""

    def __init__(self, runs: Callable[[], Iterator[list[int]]], count: int):
        self.runs, self.count = runs, count

    def __iter__(self) -> Iterator[list[int]]:
        return self.runs()

    def __len__(self) -> int:
        return self.count


class GlobalOrderLoader:
    """Micro-batches of ``batch_size`` samples per rank from one global, world-size independent order.

    Args:
        dataset: a map-style dataset (``__getitem__`` by index), e.g. a litdata ``StreamingDataset``.
        batch_size: the micro-batch, samples per rank and forward pass; may be changed between any two
            optimizer steps (``BatchWarmup`` does, with ``max_micro_batch_size``).
        shuffle: permute the samples each epoch, seeded by ``(seed, epoch)``; False: dataset order.
        seed: the order's seed.
        num_workers: as for ``torch.utils.data.DataLoader``.
        collate_fn: as for ``torch.utils.data.DataLoader``.
        pin_memory: as for ``torch.utils.data.DataLoader``.
        num_replicas: the number of data-parallel ranks. Default: the default process group's
            (torch.distributed), else 1. ``TokenDataModule`` passes the Lightning strategy's.
        rank: this process's data-parallel rank. Default: the default process group's, else 0.

    Raises:
        LitCBSConfigError: ``batch_size`` or ``num_replicas`` not an int >= 1, ``num_workers`` not an
            int >= 0, only one of ``num_replicas`` and ``rank`` given, or ``rank`` outside
            [0, ``num_replicas``).

    Attributes:
        epoch: the epoch whose order is read.
        position: samples consumed this epoch, over all ranks (the data position).
        micro_batches: micro-batches this rank has yielded this epoch.
        last_samples, last_round_samples: samples in the micro-batch this rank yielded last, and in its
            round over all ranks (fewer than ``batch_size`` and ``batch_size`` x ranks in an epoch's last
            round); None before the first.

    Examples:
        Rank 0 of 2 reads micro-batches of 2 samples from 12, in dataset order: rank 1 reads 2 and 3 beside its
        0 and 1. Set to 4 samples between two steps, it reads on from position 4, in runs of 4 (rank 1 takes 8 to 11):

        >>> import torch
        >>> from lit_cbs.data import GlobalOrderLoader
        >>> loader = GlobalOrderLoader(torch.arange(12), batch_size=2, shuffle=False, num_replicas=2, rank=0)
        >>> len(loader)  # micro-batches this rank yields this epoch: 12 samples in rounds of 2 x 2 ranks
        3
        >>> batches = iter(loader)
        >>> next(batches).tolist(), loader.position, loader.micro_batches
        ([0, 1], 4, 1)
        >>> loader.batch_size = 4
        >>> [batch.tolist() for batch in batches], loader.position, len(loader)
        ([[4, 5, 6, 7]], 12, 2)

        The order of an epoch depends on ``(seed, epoch)`` alone, so a run on one rank trains on the same
        samples, in the same steps:

        >>> single = GlobalOrderLoader(list(range(10)), batch_size=4, seed=0)
        >>> [batch.tolist() for batch in single]
        [[4, 6, 2, 7], [3, 5, 9, 0], [8, 1]]
        >>> single.state_dict()["position"], single.epoch
        (10, 0)
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        num_replicas: int | None = None,
        rank: int | None = None,
    ):
        self.num_samples = global_sample_count(dataset)
        # Read by index: an iterable-style dataset that supports it (litdata's) through a map-style view.
        self.dataset = _ByIndex(dataset, self.num_samples) if isinstance(dataset, IterableDataset) else dataset
        positive_int("batch_size", batch_size, "samples per rank")  # LitCBSConfigError unless an int >= 1
        self._batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise LitCBSConfigError(f"num_workers={num_workers!r} must be an int >= 0 (worker processes)")
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory
        if (num_replicas is None) != (rank is None):
            raise LitCBSConfigError(f"give both num_replicas and rank, or neither (got {num_replicas!r} and {rank!r})")
        self._replicas: tuple[int, int] | None = None
        if num_replicas is not None and rank is not None:  # both or neither (above)
            positive_int("num_replicas", num_replicas, "ranks")  # LitCBSConfigError unless an int >= 1
            self._replicas = (num_replicas, int(rank))
            if not 0 <= rank < num_replicas:
                raise LitCBSConfigError(f"rank={rank} must lie in [0, num_replicas={num_replicas})")
        self.epoch = 0
        self.position = 0
        self.micro_batches = 0
        self.last_samples: int | None = None
        self.last_round_samples: int | None = None
        self._exhausted = False
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, order) of the epoch last read
        self._batches: Iterator | None = None  # the running read, from _run_start on
        self._run_start = 0

    # ------------------------------------------------------------------ what Lightning and BatchWarmup set
    @property
    def batch_size(self) -> int:
        """Samples per micro-batch and rank. Set between two optimizer steps, it applies from the next
        micro-batch on, read from the position now.

        Raises:
            LitCBSConfigError: when set to other than an int >= 1.
        """
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        positive_int("batch_size", value, "samples per rank")  # LitCBSConfigError unless an int >= 1
        if value != self._batch_size:
            self._batch_size = value
            self._batches = None  # the next micro-batch is read from the position now, in runs of the new size

    @property
    def sampler(self) -> GlobalOrderLoader:
        """Where Lightning looks for ``set_epoch`` at the start of every epoch."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch``'s order; from its start, unless the position is already in it (a resumed run).

        Args:
            epoch: the epoch (0-based) whose order to read; Lightning calls this at every epoch's start.
        """
        if epoch != self.epoch:
            self.epoch, self.position, self.micro_batches = epoch, 0, 0
            self._batches = None
        self._exhausted = False

    def topology(self) -> tuple[int, int]:
        """The ranks the samples are dealt to.

        Returns:
            (data-parallel ranks, this rank): those given, else the default process group's, else (1, 0).
        """
        if self._replicas is not None:
            return self._replicas
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size(), torch.distributed.get_rank()
        return 1, 0

    # ------------------------------------------------------------------ iteration
    def _remaining_micro_batches(self) -> int:
        world, _ = self.topology()
        return -(-(self.num_samples - self.position) // (self._batch_size * world))  # the last, short round included

    def _next_round(self) -> tuple[int, int]:
        """(samples of this rank, samples over all ranks) in the round read next."""
        world, rank = self.topology()
        round_samples = min(self._batch_size * world, self.num_samples - self.position)
        return round_share(round_samples, rank, world)[1], round_samples

    @property
    def deals_unevenly(self) -> bool:
        """Whether an epoch's last round can leave the ranks different numbers of samples, some perhaps none
        (a micro-batch of zero samples): only where the dataset's size is no multiple of the ranks (every
        round before it takes a multiple of them)."""
        world, _ = self.topology()
        return self.num_samples % world != 0

    def empty_batch(self) -> Any:
        """A micro-batch of zero samples as the loader yields one, built from the dataset's first sample.

        Returns:
            The collated batch of the first sample with every tensor and numpy array cut to zero rows.
        """
        return zero_rows(self._collate([self.dataset[0]]))

    def _collate(self, samples: list[Any]) -> Any:
        return (self.collate_fn or default_collate)(samples)

    def __len__(self) -> int:
        """Micro-batches this rank yields this epoch at the current micro-batch size (those yielded included)."""
        return self.micro_batches + self._remaining_micro_batches()

    def __iter__(self) -> Iterator[Any]:
        if self._exhausted:  # used outside Lightning, which calls set_epoch: the next epoch follows
            self.set_epoch(self.epoch + 1)
        self._batches = None
        return _Iteration(self)

    def _next(self) -> Any:
        if self._batches is None:
            self._batches = self._read_from_position()
        try:
            batch = next(self._batches)
        except StopIteration:
            self._exhausted = True
            self._batches = None
            raise
        samples, round_samples = self._next_round()
        if samples == 0:
            batch = zero_rows(batch)  # read one sample of the round for its structure (see _read_from_position)
        self.micro_batches += 1
        self.position += round_samples
        self.last_samples, self.last_round_samples = samples, round_samples
        return batch

    def _read_from_position(self) -> Iterator[Any]:
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, epoch_order(self.num_samples, self.seed, self.epoch, self.shuffle))
        order, start, micro = self._order[1], self.position, self._batch_size
        world, rank = self.topology()

        def index_runs() -> Iterator[list[int]]:
            # An empty share reads the round's first sample, which _next cuts to zero rows: collate_fn sees samples.
            rounds = range(start, len(order), micro * world)
            for base, indices in zip(rounds, rank_micro_batches(order, start, micro, rank, world)):
                yield indices or [int(order[base])]

        runs = _IndexRuns(index_runs, self._remaining_micro_batches())
        # Worker seeds from a generator of the loader's own, so that no global random stream moves.
        generator = torch.Generator().manual_seed(
            int(np.random.default_rng([self.seed, self.epoch, start]).integers(2**62))
        )
        return iter(
            DataLoader(
                self.dataset,
                batch_sampler=runs,
                num_workers=self.num_workers,
                collate_fn=self.collate_fn,
                pin_memory=self.pin_memory,
                generator=generator,
            )
        )

    def peek(self, count: int) -> list[Any]:
        """The next ``count`` micro-batches this rank reads from its position on (into the next epochs' orders
        where this one ends), leaving the loader where it is: the data a run at this micro-batch would train
        on next (a CBS probe of a checkpoint reads its window this way).

        Args:
            count: micro-batches to read.

        Returns:
            The ``count`` micro-batches, in the order this rank would read them.

        Raises:
            LitCBSConfigError: the dataset makes no micro-batch at all (two epochs in a row yield none).
        """
        reader = copy.copy(self)
        reader._batches, reader._exhausted = None, False
        batches: list[Any] = []
        empty_epochs = 0
        while len(batches) < count:
            try:
                batches.append(reader._next())
                empty_epochs = 0
            except StopIteration:
                empty_epochs += 1
                if empty_epochs > 1:
                    raise LitCBSConfigError(
                        f"the dataset's {self.num_samples} samples make no micro-batch of {self._batch_size} samples "
                        f"on each of {reader.topology()[0]} ranks"
                    ) from None
                reader.set_epoch(reader.epoch + 1)
        return batches

    # ------------------------------------------------------------------ checkpointing (Lightning's _Stateful)
    def state_dict(self) -> dict[str, Any]:
        """The data position (epoch, samples consumed this epoch over all ranks, micro-batches this rank
        yielded) and what the order depends on, for a checkpoint (Lightning saves it with the fit loop)."""
        world, _ = self.topology()
        return {
            "epoch": self.epoch,
            "position": self.position,
            "micro_batches": self.micro_batches,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "data_parallel_size": world,
            "batch_size": self._batch_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Go on from a ``state_dict``'s position, on any number of ranks and at any micro-batch.

        Args:
            state_dict: what ``state_dict`` returned.

        Raises:
            LitCBSConfigError: the checkpoint read other data (``num_samples``) or another order (``seed``,
                ``shuffle``).
        """
        for name in ("num_samples", "seed", "shuffle"):
            if state_dict[name] != getattr(self, name):
                raise LitCBSConfigError(
                    f"the checkpoint's train loader read {name}={state_dict[name]!r} but this one has "
                    f"{name}={getattr(self, name)!r}: resume on the same data and seed, or start afresh"
                )
        self.epoch, self.position, self.micro_batches = (
            state_dict["epoch"],
            state_dict["position"],
            state_dict["micro_batches"],
        )
        self.last_samples = self.last_round_samples = None
        self._batches = None
        self._exhausted = False


class _Iteration:
    """The iterator ``iter(loader)`` returns; the position lives in the loader."""

    def __init__(self, loader: GlobalOrderLoader):
        self.loader = loader

    def __iter__(self) -> _Iteration:
        return self

    def __next__(self) -> Any:
        return self.loader._next()
