"""``GlobalOrderLoader``: micro-batches cut from one global sample order (any micro-batch, any number of ranks)."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, default_collate

from lit_cbs._internals import tree_map
from lit_cbs.errors import LitCBSConfigError, positive_int

__all__ = ["GlobalOrderLoader"]

_END = object()  # a sentinel no batch is


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The epoch's order of sample indices: a permutation seeded by (seed, epoch) alone, or 0..n-1."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(num_samples).astype(np.int64, copy=False)


def _round_share(round_samples: int, rank: int, world: int) -> tuple[int, int]:
    """(offset, samples) of ``rank``'s share of a round dealt to ``world`` ranks in order, the first ones 1 more."""
    base, extra = divmod(round_samples, world)
    return rank * base + min(rank, extra), base + (rank < extra)


def _zero_rows(batch: Any) -> Any:
    """``batch`` with every tensor and numpy array cut to zero rows: a micro-batch of no sample."""
    return tree_map(lambda leaf: leaf[:0] if isinstance(leaf, (torch.Tensor, np.ndarray)) else leaf, batch)


class GlobalOrderLoader:
    """Micro-batches of ``batch_size`` samples per rank from one global, world-size independent order; a new
    ``batch_size`` applies from the next micro-batch, and ``state_dict`` carries the position.

    Args:
        dataset: a map-style dataset, or litdata's ``StreamingDataset``.
        batch_size: samples per rank and forward pass; may change between any two optimizer steps.
        shuffle: permute the samples each epoch, seeded by ``(seed, epoch)``; False: dataset order.
        num_replicas: the data-parallel ranks, given with ``rank`` or neither (the default process group's).
        rank: this rank.

    Examples:
        Rank 0 of 2, in dataset order (rank 1 reads 2 and 3), then set to 4 samples (rank 1 takes 8 to 11):

        >>> import torch
        >>> from lit_cbs.data import GlobalOrderLoader
        >>> loader = GlobalOrderLoader(torch.arange(12), batch_size=2, shuffle=False, num_replicas=2, rank=0)
        >>> batches = iter(loader)
        >>> next(batches).tolist(), loader.position, loader.micro_batches
        ([0, 1], 4, 1)
        >>> loader.batch_size = 4
        >>> [batch.tolist() for batch in batches], loader.position, len(loader)  # len: micro-batches this epoch
        ([[4, 5, 6, 7]], 12, 2)
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
    ):
        # All samples: litdata's ``StreamingDataset`` reports its rank's share as ``len()``.
        regions = getattr(dataset, "region_of_interest", None) or [(0, len(dataset))]  # type: ignore[arg-type]
        self.num_samples = int(sum(end - start for start, end in regions))
        # Read by index: an iterable-style dataset that supports it (litdata's) through a map-style view.
        self.dataset = Subset(dataset, range(self.num_samples)) if isinstance(dataset, IterableDataset) else dataset
        self._batch_size = positive_int("batch_size", batch_size, "samples per rank")
        self.shuffle, self.seed = bool(shuffle), int(seed)
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise LitCBSConfigError(f"num_workers={num_workers!r} must be an int >= 0 (worker processes)")
        self.num_workers, self.collate_fn = num_workers, collate_fn
        if (num_replicas is None) != (rank is None):
            raise LitCBSConfigError(f"give both num_replicas and rank, or neither (got {num_replicas!r} and {rank!r})")
        self._replicas: tuple[int, int] | None = None
        if num_replicas is not None and rank is not None:  # both or neither (above)
            self._replicas = (positive_int("num_replicas", num_replicas, "ranks"), int(rank))
            if not 0 <= rank < num_replicas:
                raise LitCBSConfigError(f"rank={rank} must lie in [0, num_replicas={num_replicas})")
        self.epoch = self.position = self.micro_batches = 0
        self.last_samples: int | None = None  # in the micro-batch this rank yielded last
        self.last_round_samples: int | None = None  # in that micro-batch's round over all ranks
        self._exhausted = False
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, order) of the epoch last read
        self._batches: Iterator[Any] | None = None  # the running read

    @property
    def batch_size(self) -> int:
        """Samples per micro-batch and rank; set between two steps, it applies from the next micro-batch."""
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        positive_int("batch_size", value, "samples per rank")
        if value != self._batch_size:
            self._batch_size = value
            self._batches = None  # the next micro-batch is read from the position now, in runs of the new size

    @property
    def sampler(self) -> GlobalOrderLoader:
        """Where Lightning looks for ``set_epoch``."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch``'s order; from its start, unless the position is already in it (a resumed run)."""
        if epoch != self.epoch:
            self.epoch, self.position, self.micro_batches, self._batches = epoch, 0, 0, None
        self._exhausted = False

    def topology(self) -> tuple[int, int]:
        """(data-parallel ranks, this rank)."""
        if self._replicas is not None:
            return self._replicas
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size(), torch.distributed.get_rank()
        return 1, 0

    @property
    def deals_unevenly(self) -> bool:
        """Whether an epoch's last round can leave ranks different numbers of samples."""
        world, _ = self.topology()
        return self.num_samples % world != 0

    def empty_batch(self) -> Any:
        """A micro-batch of zero samples, as the loader yields one."""
        return _zero_rows((self.collate_fn or default_collate)([self.dataset[0]]))

    def __len__(self) -> int:
        """Micro-batches this rank yields this epoch at the current micro-batch size (those yielded included)."""
        world, _ = self.topology()
        return self.micro_batches - (-(self.num_samples - self.position) // (self._batch_size * world))

    def __iter__(self) -> Iterator[Any]:
        if self._exhausted:  # used outside Lightning, which calls set_epoch: the next epoch follows
            self.set_epoch(self.epoch + 1)
        self._batches = None
        return iter(self._next, _END)  # ends where _next raises StopIteration; the position lives in the loader

    def _next(self) -> Any:
        if self._batches is None:
            self._batches = self._read_from_position()
        try:
            batch = next(self._batches)
        except StopIteration:
            self._exhausted, self._batches = True, None
            raise
        world, rank = self.topology()
        round_samples = min(self._batch_size * world, self.num_samples - self.position)
        samples = _round_share(round_samples, rank, world)[1]
        if samples == 0:
            batch = _zero_rows(batch)  # read one sample of the round for its structure (see _read_from_position)
        self.micro_batches, self.position = self.micro_batches + 1, self.position + round_samples
        self.last_samples, self.last_round_samples = samples, round_samples
        return batch

    def _read_from_position(self) -> Iterator[Any]:
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, epoch_order(self.num_samples, self.seed, self.epoch, self.shuffle))
        order, start, micro = self._order[1], self.position, self._batch_size
        world, rank = self.topology()

        def index_runs() -> Iterator[list[int]]:
            # An empty share reads the round's first sample (collate_fn sees samples), which _next cuts to zero rows.
            stride = micro * world
            for base in range(start, len(order), stride):
                offset, samples = _round_share(min(stride, len(order) - base), rank, world)
                yield order[base + offset : base + offset + samples].tolist() or [int(order[base])]

        # Worker seeds from a generator of the loader's own, so that no global random stream moves.
        generator = torch.Generator().manual_seed(
            int(np.random.default_rng([self.seed, self.epoch, start]).integers(2**62))
        )
        return iter(
            DataLoader(
                self.dataset,
                batch_sampler=index_runs(),
                num_workers=self.num_workers,
                collate_fn=self.collate_fn,
                generator=generator,
            )
        )

    def peek(self, count: int) -> list[Any]:
        """The next ``count`` micro-batches this rank reads (into the next epochs), leaving the loader where it is."""
        reader = copy.copy(self)
        reader._batches, reader._exhausted = None, False
        batches: list[Any] = []
        while True:
            read = list(itertools.islice(iter(reader._next, _END), count - len(batches)))
            batches += read
            if len(batches) == count:
                return batches
            if not read and reader.epoch != self.epoch:  # a whole epoch made none
                raise LitCBSConfigError(
                    f"the dataset's {self.num_samples} samples make no micro-batch of {self._batch_size} samples "
                    f"on each of {reader.topology()[0]} ranks"
                )
            reader.set_epoch(reader.epoch + 1)

    def state_dict(self) -> dict[str, Any]:
        """The data position, and what the order depends on."""
        state = {
            key: getattr(self, key) for key in ("epoch", "position", "micro_batches", "num_samples", "seed", "shuffle")
        }
        return {**state, "data_parallel_size": self.topology()[0], "batch_size": self._batch_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Go on from a ``state_dict``'s position, on any ranks and micro-batch (the same data, seed and shuffle)."""
        for name in ("num_samples", "seed", "shuffle"):
            if state_dict[name] != getattr(self, name):
                raise LitCBSConfigError(
                    f"the checkpoint's train loader read {name}={state_dict[name]!r} but this one has "
                    f"{name}={getattr(self, name)!r}: resume on the same data and seed, or start afresh"
                )
        self.epoch, self.position, self.micro_batches = (state_dict[k] for k in ("epoch", "position", "micro_batches"))
        self.last_samples = self.last_round_samples = self._batches = None
        self._exhausted = False
