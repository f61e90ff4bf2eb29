"""Metal source of the dedup verify kernels: grouped, quantized expert matvecs.

Shapes: P = (token, expert) pairs of the window, sorted by expert; G = P group slots
(only the first n_unique are non-empty); S = cache slots; D_IN = reduction width;
D_OUT = output width; words per weight row = D_IN * BITS / 32.

A window's pairs arrive sorted by expert and cut into groups by CSR `offsets`: group g
owns sorted positions [offsets[g], offsets[g+1]), all routed to slot experts[offsets[g]].
One simdgroup owns one (group, output row) pair: its 32 lanes walk that weight row
word by word, dequantize each word once (affine: w = scale * q + bias) and accumulate
it into every row of the group, up to ROWS rows at a time in registers. A group with
more than ROWS rows walks the weight row again per ROWS rows, so a weight block is
read ceil(rows / ROWS) times instead of once per row.

- `GATE_UP_SOURCE`: h[p] = silu(x[rows[p]] . Wg) * (x[rows[p]] . Wu), gate and up
  dequantized in the same pass (fused SwiGLU). grid (32, D_OUT, G).
- `DOWN_SOURCE`: y[p] = h[p] . Wd. grid (32, D_OUT, G).

Invariants: the grid's y extent is exactly D_OUT and its z extent exactly G, so every
launched simdgroup has a valid output row and group (dispatchThreads launches no
threads past the grid); a simdgroup returns as a whole (empty group) or not at all, so
the simd_sum calls see all 32 lanes; BITS divides 32, so no value straddles two words,
and GS is a multiple of 32 / BITS, so one word never straddles two scale groups.
Row loops have the constant bound ROWS (and break at the group's end) so the
compiler can keep the accumulators in registers. Accumulation is float32; gate and up are rounded to the output type before SwiGLU, as
the stock path (whose gather_qmm returns that type) does.
"""

from __future__ import annotations

import mlx.core as mx

KERNEL_BITS = (2, 4, 8)  # widths whose values never straddle a uint32 word
ROWS = 8  # rows of a group accumulated per walk over a weight row (registers per lane: 2 * ROWS)

_PREAMBLE = """
    constexpr int PF = 32 / BITS;
    constexpr int WORDS = D_IN / PF;
    constexpr int GROUPS = D_IN / GS;
    constexpr uint MASK = (1u << BITS) - 1u;

    const uint lane = thread_index_in_simdgroup;
    const uint n = thread_position_in_grid.y;
    const uint g = thread_position_in_grid.z;
    const uint start = offsets[g];
    const uint end = offsets[g + 1];
    if (start >= end) {
        return;
    }
    const size_t row_of_w = size_t(experts[start]) * D_OUT + n;
"""

GATE_UP_SOURCE = _PREAMBLE + """
    const device uint32_t* wg_row = wg + row_of_w * WORDS;
    const device uint32_t* wu_row = wu + row_of_w * WORDS;
    auto sg_row = sg + row_of_w * GROUPS;
    auto bg_row = bg + row_of_w * GROUPS;
    auto su_row = su + row_of_w * GROUPS;
    auto bu_row = bu + row_of_w * GROUPS;

    for (uint r0 = start; r0 < end; r0 += ROWS) {
        const uint nr = min(uint(ROWS), end - r0);
        float acc_g[ROWS];
        float acc_u[ROWS];
        for (int r = 0; r < ROWS; r++) {
            acc_g[r] = 0.0f;
            acc_u[r] = 0.0f;
        }
        for (uint i = lane; i < uint(WORDS); i += 32) {
            const uint q = i * PF / GS;
            const float s_g = float(sg_row[q]), b_g = float(bg_row[q]);
            const float s_u = float(su_row[q]), b_u = float(bu_row[q]);
            uint32_t word_g = wg_row[i];
            uint32_t word_u = wu_row[i];
            float vg[PF];
            float vu[PF];
            for (int p = 0; p < PF; p++) {
                vg[p] = s_g * float(word_g & MASK) + b_g;
                vu[p] = s_u * float(word_u & MASK) + b_u;
                word_g >>= BITS;
                word_u >>= BITS;
            }
            for (uint r = 0; r < uint(ROWS); r++) {
                if (r >= nr) {
                    break;
                }
                auto xr = x + size_t(rows[r0 + r]) * D_IN + size_t(i) * PF;
                float dg = 0.0f, du = 0.0f;
                for (int p = 0; p < PF; p++) {
                    const float xv = float(xr[p]);
                    dg += xv * vg[p];
                    du += xv * vu[p];
                }
                acc_g[r] += dg;
                acc_u[r] += du;
            }
        }
        for (uint r = 0; r < uint(ROWS); r++) {
            if (r >= nr) {
                break;
            }
            const float gate = float(T(simd_sum(acc_g[r])));
            const float up = float(T(simd_sum(acc_u[r])));
            if (lane == 0) {
                const float silu = gate / (1.0f + metal::exp(-gate));
                h[size_t(r0 + r) * D_OUT + n] = T(silu * up);
            }
        }
    }
"""

DOWN_SOURCE = _PREAMBLE + """
    const device uint32_t* w_row = wd + row_of_w * WORDS;
    auto s_row = sd + row_of_w * GROUPS;
    auto b_row = bd + row_of_w * GROUPS;

    for (uint r0 = start; r0 < end; r0 += ROWS) {
        const uint nr = min(uint(ROWS), end - r0);
        float acc[ROWS];
        for (int r = 0; r < ROWS; r++) {
            acc[r] = 0.0f;
        }
        for (uint i = lane; i < uint(WORDS); i += 32) {
            const uint q = i * PF / GS;
            const float s = float(s_row[q]), b = float(b_row[q]);
            uint32_t word = w_row[i];
            float v[PF];
            for (int p = 0; p < PF; p++) {
                v[p] = s * float(word & MASK) + b;
                word >>= BITS;
            }
            for (uint r = 0; r < uint(ROWS); r++) {
                if (r >= nr) {
                    break;
                }
                auto hr = h + size_t(r0 + r) * D_IN + size_t(i) * PF;
                float d = 0.0f;
                for (int p = 0; p < PF; p++) {
                    d += float(hr[p]) * v[p];
                }
                acc[r] += d;
            }
        }
        for (uint r = 0; r < uint(ROWS); r++) {
            if (r >= nr) {
                break;
            }
            const float total = simd_sum(acc[r]);
            if (lane == 0) {
                y[size_t(r0 + r) * D_OUT + n] = T(total);
            }
        }
    }
"""


def build_kernels() -> tuple[object, object]:
    """The (gate_up, down) kernels as mx.fast.metal_kernel callables.

    Construction only records the source, so it works on any MLX build; the source is
    compiled by Metal on the first launch, which only a Metal device can do.
    """
    gate_up = mx.fast.metal_kernel(
        name="specmoe_dedup_gate_up",
        input_names=["x", "rows", "offsets", "experts", "wg", "sg", "bg", "wu", "su", "bu"],
        output_names=["h"],
        source=GATE_UP_SOURCE,
    )
    down = mx.fast.metal_kernel(
        name="specmoe_dedup_down",
        input_names=["h", "offsets", "experts", "wd", "sd", "bd"],
        output_names=["y"],
        source=DOWN_SOURCE,
    )
    return gate_up, down
