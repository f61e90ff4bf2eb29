"""A cheap fingerprint of a loaded model's trained weights.

Config digests cannot tell two trainings of the same architecture apart; a
projection fitted for one drafter would silently mislead forecasts for another.
We hash the leading bytes of the first few non-expert parameters (by name; expert
parameters are those of mlx-lm's stacked SwitchLinear / QuantizedSwitchLinear
projections, whatever the family calls the module, and of cache slabs): the
same weights give the same fingerprint whether loaded from a raw checkpoint or a
packed store, and any retraining changes it.
"""

from __future__ import annotations

import hashlib

import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

N_TENSORS = 4
N_ELEMENTS = 4096


def model_fingerprint(model) -> str:
    h = hashlib.sha256()
    experts = tuple(path + "." for path, m in model.named_modules() if isinstance(m, (SwitchLinear, QuantizedSwitchLinear)))
    params = sorted((n, p) for n, p in tree_flatten(model.parameters()) if "switch_mlp" not in n and not n.startswith(experts))
    for name, p in params[:N_TENSORS]:
        h.update(name.encode())
        h.update(np.array(p.reshape(-1)[:N_ELEMENTS]).tobytes())
    return h.hexdigest()[:16]
