"""LayerReplay: re-run a forward from decoder layer L, reusing the outputs of the layers before it.

When a forward's routed experts turn out absent at its one host sync, the layers before the
first one that missed computed the right thing (their KV/state writes are right too). To
recompute only from that layer, every decoder layer *instance* gets a subclass of its own
class (as HiddenTaps does for norms: parameter names unchanged, no mlx-lm class modified)
whose call, while a replay controller is active, records its output, or -- for layers below
`skip_below` -- returns the output recorded by the previous run without computing or touching
its cache. Outside a pass the subclass calls straight through.

Windows (a verify of several tokens): the model builds a window's attention mask from the first
cache's offset, which a kept layer has already advanced when the forward is rebuilt. Each running
layer records the arguments it was called with (the mask, its cache: no activations), and after
skip(below, same_args=True) the layers at or above `below` are called with the arguments the
first run passed them, so a window repairs from its first missing layer as it would from layer 0.

Invariants: a skipped layer returns exactly the array its previous run produced and writes no
cache; layers at or above `skip_below` run normally and record their new output (with same_args,
called with the arguments of the run that recorded them); the model's own code (embedding, masks,
final norm, head) runs unchanged; park()/resume() keep one forward's record whole while another is built.
"""

from __future__ import annotations

import mlx.core as mx

_REPLAY_CLASSES: dict[type, type] = {}


def _replay_class(cls: type) -> type:
    if cls in _REPLAY_CLASSES:
        return _REPLAY_CLASSES[cls]

    def __call__(self, x, *args, **kwargs):
        ctl = self._replay_ctl
        if not ctl.active:
            return cls.__call__(self, x, *args, **kwargs)
        i = self._replay_index
        if i < ctl.skip_below:
            return ctl.outputs[i]
        if ctl.same_args:
            args, kwargs = ctl.args[i]
        else:
            ctl.args[i] = (args, kwargs)
        out = cls.__call__(self, x, *args, **kwargs)
        ctl.outputs[i] = out
        return out

    _REPLAY_CLASSES[cls] = type(f"Replayable{cls.__name__}", (cls,), {"__call__": __call__})
    return _REPLAY_CLASSES[cls]


class LayerReplay:
    """The controller for one model's decoder layers (`model.layers`, in cache order)."""

    def __init__(self, layers):
        self.active = False  # record outputs (and skip layers below skip_below)
        self.skip_below = 0
        self.outputs: dict[int, mx.array] = {}
        self.args: dict[int, tuple] = {}  # layer index -> (args, kwargs) of its first call in this pass
        self.same_args = False  # layers at or above skip_below reuse self.args (a window's repair)
        # No reference back to the layers (they reference this controller): no cycle keeps a closed
        # model's memory alive until the garbage collector runs.
        for i, layer in enumerate(layers):
            object.__setattr__(layer, "_replay_ctl", self)
            object.__setattr__(layer, "_replay_index", i)
            layer.__class__ = _replay_class(type(layer))

    def start(self) -> None:
        """Record every layer's output from the next forward on (nothing skipped)."""
        self.active, self.skip_below, self.outputs = True, 0, {}
        self.args, self.same_args = {}, False

    def skip(self, below: int, same_args: bool = False) -> None:
        """The next forward reuses the recorded outputs of layers [0, below); with `same_args`, its layers
        from `below` on are called with the arguments the first run passed them (not the rebuilt forward's)."""
        missing = [i for i in range(below) if i not in self.outputs]
        if missing:
            raise RuntimeError(f"cannot replay from layer {below}: no recorded output of layers {missing}")
        if same_args and any(i not in self.args for i in self.outputs if i >= below):
            raise RuntimeError(f"cannot replay from layer {below} with the same arguments: none recorded")
        self.skip_below = below
        self.same_args = same_args

    def park(self) -> tuple:
        """The current forward's recorded state, to resume() after another forward was built (a device
        pass builds the next token's forward before the current one's sync: runtime/decode/device_pass.py)."""
        return self.active, self.skip_below, self.outputs, self.args, self.same_args

    def resume(self, state: tuple) -> None:
        """Make a parked forward's recorded state current again."""
        self.active, self.skip_below, self.outputs, self.args, self.same_args = state

    def stop(self) -> None:
        self.active, self.skip_below, self.outputs = False, 0, {}
        self.args, self.same_args = {}, False

    @staticmethod
    def remove(layers) -> None:
        """Give `layers` their own classes back."""
        originals = {v: k for k, v in _REPLAY_CLASSES.items()}
        for layer in layers:
            if type(layer) in originals:
                layer.__class__ = originals[type(layer)]
