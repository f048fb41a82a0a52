"""What mixes positions in a decoder layer, one module per layer kind: attention, LFM2's short convolution,
Qwen3.5's Gated DeltaNet.

A layer of any kind is: its mixer between the norm before it and the residual, then the gated MLP. The mixer
of a kind (``Mixer``) owns everything the kind brings: its matrices and vectors (``upload``), its device state
and scratch (the KV cache and RoPE tables, the conv rings, the recurrent state), the launches of its step
(``forward``), its float64 reference step (``reference``) and its state rules — whether a forward can resume
at a position, restore points, rolling back — and its host side: the matrices a source fuses for it and from
which projections, its vectors, its shapes and how its weights are read (``read``). The model
(``perfx.model``) and the sources (``perfx.sources``) ask the mixers and never the kind.

Mixers are found the way kernel specs are: every module of this package that defines ``MIXER`` (a ``Mixer``
subclass) is one, by its ``kind``. A new layer kind is a module here plus its kernels.
"""

from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from perfx.errors import PerfxError
from perfx.op import Op, StepOptions, matrix_ops


@dataclass
class Rows:
    """The rows of a batched decode step (``perfx.batch``): row i is one token of its own sequence, at its own
    position, with its own state of each mixer (a KV cache, rings, a recurrent state: what ``new_state``
    makes). The kernels that read a position on the device read row i's at index ``first + i`` of
    ``buffer`` (int32)."""

    positions: list[int]
    buffer: object
    first: int
    states: list[dict]    # per row: {mixer: its state (``Mixer.state_fields`` -> object)}

    def __len__(self) -> int:
        return len(self.positions)

    def position(self, i: int) -> tuple:
        """(buffer, index) where row i's position is read on the device."""
        return self.buffer, self.first + i

    def state(self, mixer, i: int) -> dict:
        return self.states[i][mixer]


class Mixer(ABC):
    """The layers of one kind of a model on the device: ``layers`` (their indices), each one's weights
    (``weights[layer]``), the kind's device state and scratch (``allocate``), and the step.

    ``model`` (a ``perfx.model.Model``) gives the config, device, plan (the kernels), run state and the
    Linear upload; the mixer writes its output into ``model.state.proj``, which joins the residual next."""

    kind = ""
    cache = None     # a KV cache, where the kind keeps one
    scratch = ()     # the names of its scratch buffers, as its ops read and write them

    # -- its host side: what a source reads, checks and hands over for a layer of the kind ------------
    # Class-level, no device: the sources (``perfx.sources``) ask a layer's mixer, never its kind. Tensor names
    # stay with the formats and the family files; these say what the kind has.

    Weights: type = None   # its weights, one dataclass for both sides: host matrices from the sources
                           # (``LayerWeights.mixing``), Linears on the device (``weights[layer]``); its
                           # ``matrices`` name the fields that are matrices
    fuses: dict[str, tuple[str, ...]] = {}   # a matrix role -> the source projections it stacks, where not itself
    file_fused: tuple[str, ...] = ()   # the roles (with the FFN's gate_up) a file may hold already fused (Phi-3)
    # (kind, part) of another kind whose tensor in a layer of this kind means the header assigns the layers'
    # kinds wrongly -> what to say ({arch}: the architecture, {keys}: the header keys that assign them)
    misplaced: dict[tuple[str, str], str] = {}

    @staticmethod
    def stand_ins(config) -> dict[str, str]:
        """A projection a file may lack -> the one read in its place (Gemma 4's K as V)."""
        return {}

    @classmethod
    def host_linears(cls, config) -> dict[str, tuple[str, ...]]:
        """Its matrix roles (``linears``) and the source projections each fuses, rows stacked in this order."""
        return {role: cls.fuses.get(role, (role,)) for role, _, _, _ in cls.linears(config)}

    @staticmethod
    def part_shapes(config) -> dict[str, tuple[int, int]]:
        """(N, K) of the source projections that are no role of their own (q, k, v; a and b)."""
        return {}

    @classmethod
    def host_shapes(cls, config) -> dict[str, tuple[int, int]]:
        """(N, K) of each of its roles and of each projection a source reads for them."""
        return {**{role: (n, k) for role, n, k, _ in cls.linears(config)}, **cls.part_shapes(config)}

    @staticmethod
    def host_vectors(config) -> dict[str, int]:
        """The per-layer vectors a source reads for it (besides the norms every layer has), in order, and
        their sizes."""
        return {}

    @staticmethod
    def taps(config) -> int | None:
        """The channels of its short convolution's taps (channels, config.conv_length), None where it has none."""
        return None

    @classmethod
    def read(cls, source, layer: int):
        """Layer ``layer``'s host weights (``Weights``) from ``source`` (a ``perfx.sources.base.ModelSource``):
        each role fused from its projections, the vectors, the taps."""
        c = source.config.at(layer)
        values = {role: source.read_matrix(role, parts, layer) for role, parts in cls.host_linears(c).items()}
        values.update({name: source.read_vector(name, layer) for name in cls.host_vectors(c)})
        if cls.taps(c):
            values["conv_weight"] = source.read_taps(layer)
        return cls.Weights(**values)

    @classmethod
    @abstractmethod
    def synthetic(cls, config, random_matrix, rng):
        """Random host weights (``perfx.sources.synthetic``): ``random_matrix(rng, n, k)`` an int4 matrix,
        vectors that keep activations O(1)."""

    def __init__(self, model, layers: list[int]):
        self.model, self.layers = model, list(layers)
        self.slot = {layer: i for i, layer in enumerate(self.layers)}   # its index among the layers of its kind
        self.weights: dict[int, object] = {}

    # -- what it reads, for tuning and for the load ---------------------------------------------

    @staticmethod
    @abstractmethod
    def linears(config) -> list[tuple[str, int, int, bool]]:
        """(role, N, K, bias) of each of its matrices, fused the way the loader fuses them."""

    @classmethod
    @abstractmethod
    def ops(cls, config, m: int, options: StepOptions, prefill: bool = False) -> list[Op]:
        """The ops of its layers over m rows, in launch order (``perfx.op.Op``): what `perfx tune` measures and
        the plan chooses kernels for (``perfx.step``); ``prefill``: a prefill pass's, where each matrix's GEMM
        kinds are compared per bucket. They read and write its ``scratch`` and the run state's xb and proj."""

    @classmethod
    def matrix_ops(cls, config, role: str, m: int, options: StepOptions, prefill: bool, reads: tuple[str, ...],
                   writes: tuple[str, ...]) -> list[Op]:
        """The ops of one of its matrices on its layers (``perfx.op.matrix_ops``)."""
        n, k, bias = next((n, k, bias) for r, n, k, bias in cls.linears(config) if r == role)
        return matrix_ops(config, role, m, options, prefill, tuple(config.layers_of(cls.kind)), reads, writes,
                          dims=(n, k, bias))

    @abstractmethod
    def upload(self, w, layer: int) -> int:
        """Upload layer ``layer``'s mixing weights from the host ``LayerWeights`` ``w`` (its ``mixing``) into
        ``weights[layer]``; the host bytes a decode step reads of them."""

    @abstractmethod
    def xb_readers(self, layer: int) -> list:
        """The Linears of ``layer`` that read the norm before it (xb), in order."""

    @abstractmethod
    def linears_of(self, layer: int) -> list:
        """Every Linear of ``layer``'s mixing."""

    def allocate(self) -> None:
        """Its device state and scratch, once every layer is uploaded (the run state ``model.state`` is)."""

    # -- the step --------------------------------------------------------------------------------

    @abstractmethod
    def forward(self, layer: int, m: int, pos: int, decode: bool, position=None, split=None) -> None:
        """Enqueue ``layer``'s mixing over m rows of xb at positions pos..pos+m−1, output into proj.
        ``position`` (buffer, index): where a decode step reads ``pos`` on the device; ``split(mixer, layer)``:
        called in place of the launches whose grid depends on the position (``partitions``), which a decode
        recording records apart (``record_varying``)."""

    def partitions(self, pos: int) -> int:
        """What the launches recorded apart depend on at ``pos`` (0: none are)."""
        return 0

    def record_varying(self, layer: int, pos: int, position) -> None:
        """Enqueue the launches of ``layer`` that ``forward`` left to ``split``."""

    @staticmethod
    @abstractmethod
    def reference(xb: np.ndarray, w, config, cache, layer: int, positions: np.ndarray, recipe) -> np.ndarray:
        """The float64 mixing of ``layer`` over the normed rows xb at ``positions`` (``perfx.forward64``),
        with the host ``LayerWeights`` ``w`` (its ``mixing``), updating ``cache``: its output before the post-norm
        and the residual."""

    # -- several sequences at once (``perfx.batch``) ------------------------------------------------------

    # the attributes that hold one sequence's state (its KV cache, rings, recurrent state): a batch gives each
    # sequence its own (``new_state``) and binds a sequence's in place of them to prefill it
    state_fields: tuple[str, ...] = ()

    def new_state(self) -> dict:
        """A fresh state for one more sequence, as ``allocate`` makes the first: ``state_fields`` -> object."""
        return {}

    def own_state(self) -> dict:
        """The state its attributes hold now (``state_fields`` -> object)."""
        return {name: getattr(self, name) for name in self.state_fields}

    def bind(self, state: dict) -> None:
        """Hold ``state`` (``new_state``'s or ``own_state``'s) in its attributes: the forward runs on it."""
        for name, value in state.items():
            setattr(self, name, value)

    def copy_state(self, src: dict, dst: dict, positions: int) -> None:
        """Make the state ``dst`` hold what ``src`` holds for positions 0..positions−1, copied on the device, so a
        sequence that starts with the same ids continues from there without running them. ``src`` serves a
        forward at ``positions`` as it is (``live_at``); ``dst`` then does too, its positions 0..positions−1 run."""
        if self.state_fields:
            raise PerfxError(f"layer kind {self.kind!r} cannot copy one sequence's state into another's")

    @classmethod
    def decodes_rows(cls) -> bool:
        """Whether its layers run in a batched decode step: it defines its own ``forward_rows``."""
        return cls.forward_rows is not Mixer.forward_rows

    def forward_rows(self, layer: int, m: int, rows: Rows) -> None:
        """Enqueue ``layer``'s mixing of the m rows of xb of a batched decode step (``rows``: each its own
        sequence's token, position and state), output into proj: the matrices over the m rows at once, what
        mixes positions row by row on each row's own state."""
        raise PerfxError(f"layer kind {self.kind!r} cannot decode several sequences together yet: serve with "
                         "--parallel 1")

    def _row_scratch(self, name: str, floats: int):
        """A one-row scratch buffer of ``floats`` float32 for ``forward_rows``, made on first use."""
        scratch = self.__dict__.setdefault("_rows_scratch", {})
        if name not in scratch:
            scratch[name] = self.model.device.empty(floats, np.float32)
        return scratch[name]

    # -- state rules -----------------------------------------------------------------------------

    can_roll_back = True   # a forward may resume before the last position run without a restore point

    def state_report(self) -> dict:
        """Bytes of its device state, by the load report's keys."""
        return {}

    def restore_parts(self) -> list:
        """What a restore point must hold of its state (``perfx.ops.restore_points``); empty: nothing."""
        return []

    def live_at(self, pos: int, written: int) -> bool:
        """Whether its state on the device serves a forward at ``pos`` as it is, positions 0..written−1 run."""
        return True

    def reset(self) -> None:
        """A forward from position 0: its state starts from zeros."""

    def fill(self, value: float) -> None:
        """Arbitrary values in its state (benchmarks: a decode step at a position reads as much as there)."""

    def resume_error(self, pos: int, written: int, kept: list[int]) -> str | None:
        """Why a forward cannot continue at ``pos`` (restore points at ``kept``), or None."""
        return None


def discover_mixers() -> dict[str, type[Mixer]]:
    """kind -> Mixer class, from every module of this package that defines ``MIXER``."""
    found: dict[str, type[Mixer]] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        mixer = getattr(module, "MIXER", None)
        if mixer is None:
            continue
        if mixer.kind in found:
            raise PerfxError(f"two mixers for layer kind {mixer.kind!r}: {found[mixer.kind].__name__} and "
                             f"{mixer.__name__}")
        found[mixer.kind] = mixer
    return found


MIXERS: dict[str, type[Mixer]] = discover_mixers()


def mixer_class(kind: str) -> type[Mixer]:
    if kind not in MIXERS:
        raise PerfxError(f"layer kind {kind!r} has no mixer; perfx runs {', '.join(sorted(MIXERS))}")
    return MIXERS[kind]
