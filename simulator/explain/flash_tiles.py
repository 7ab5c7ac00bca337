"""flash-tiles: the standard, FlashAttention-1 and FlashAttention-2 schedules, replayed from the tile simulator's
timeline one step at a time: which tiles sit in SRAM, what was just loaded or stored, the bytes per tensor so far.

A step is one inner-loop iteration of a schedule: the loads that open it, the on-chip compute, the stores that
close it (``steps``). The totals of the replay are the simulator's counts, which equal the cost model's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kernels.attn import reference

from .. import costs, tiles
from ..hardware import load
from ._lesson import num

TITLE = "flash-tiles: where the bytes go, tile by tile"
SUMMARY = "standard vs FlashAttention-1 vs -2 animated from the tile simulator's timeline; totals = cost model"
OPTIONS = ("seed", "tile")
ALGORITHMS = {"standard": (tiles.standard_forward, costs.standard_forward),
              "flash1": (tiles.flash1_forward, costs.flash1_forward),
              "flash2": (tiles.flash2_forward, costs.flash2_forward)}
LABELS = {"standard": "standard", "flash1": "FlashAttention-1", "flash2": "FlashAttention-2"}
BLOCK = 2  # Br = Bc: rows of a Q/O tile and of a K/V tile (small, so each tile is one cell of the picture)
D = 8  # head dim
ELEM_BYTES = 2  # fp16 tensors; statistics float32 (the simulator's and the cost model's convention)
REAL_N, REAL_D, REAL_HEADS, REAL_HARDWARE = 4096, 64, 16, "H100-SXM"  # a realistic size for the comparison
BAR_TENSORS = ("Q", "K", "V", "S", "P", "O", "l", "m", "lse")


def steps(timeline):
    """Group a timeline into steps: a step opens with loads (or with the first event of a kernel) and runs through
    its compute and stores; the next load after a compute or store opens the next step."""
    out = []
    for ev in timeline:
        opens = (not out or ev.kernel != out[-1][0].kernel
                 or (ev.op == "load" and any(e.op in ("compute", "store") for e in out[-1])))
        if opens:
            out.append([ev])
        else:
            out[-1].append(ev)
    return out


@dataclass
class Frame:
    """The state after one step: tiles in SRAM (tensor -> set of (row, col) cells), the tiles just loaded and
    stored, the bytes moved so far per tensor (reads + writes) and the SRAM in use."""

    kernel: str
    on_chip: dict = field(default_factory=dict)
    loaded: set = field(default_factory=set)
    stored: set = field(default_factory=set)
    moved: dict = field(default_factory=dict)
    sram_used: int = 0


def _cells(tensor, rows, cols, block):
    """(tensor, tile row, tile col) cells a transfer covers; col is 0 for the one-dimensional tensors."""
    r = range(rows[0] // block, -(-rows[1] // block)) if rows else [0]
    c = range(cols[0] // block, -(-cols[1] // block)) if cols else [0]
    return {(tensor, i, j) for i in r for j in c}


def frames(timeline, block):
    """Replay ``timeline`` step by step into one ``Frame`` per step."""
    slots, moved, out, kernel = {}, {}, [], None
    for step in steps(timeline):
        loaded, stored = set(), set()
        for ev in step:
            if ev.kernel != kernel:
                slots, kernel = {}, ev.kernel  # SRAM does not survive a kernel boundary
            if ev.op == "load":
                slots[ev.slot] = _cells(ev.name, ev.rows, ev.cols, block)
                loaded |= slots[ev.slot]
                moved[ev.name] = moved.get(ev.name, 0) + ev.nbytes
            elif ev.op == "store":
                stored |= _cells(ev.name, ev.rows, ev.cols, block)
                moved[ev.name] = moved.get(ev.name, 0) + ev.nbytes
            elif ev.op == "free":
                slots.pop(ev.name, None)
            elif ev.op == "compute" and ev.name.startswith("S ="):
                # the score tile S_ij = Q_i K_jᵀ exists on chip: rows of the Q tile, columns of the K tile
                q_rows = {i for t, i, _ in slots.get("Q_i", ()) if t == "Q"}
                k_rows = {i for t, i, _ in slots.get("K_j", ()) if t == "K"}
                slots["S_ij"] = {("S", i, j) for i in q_rows for j in k_rows}
        on_chip = {}
        for cells in slots.values():
            for tensor, i, j in cells:
                on_chip.setdefault(tensor, set()).add((i, j))
        out.append(Frame(kernel, on_chip, loaded, stored, dict(moved), step[-1].sram_used))
    return out


def simulate(seed=0, n_tiles=8):
    """Run the three schedules on one (batch, head) of N = n_tiles · BLOCK queries and keys: {name: (SimResult,
    Cost)} with the simulator's counted bytes and the cost model's, at the same tiles and SRAM."""
    rng = np.random.default_rng(seed)
    n = n_tiles * BLOCK
    q, k, v = (rng.standard_normal((1, 1, n, D)) for _ in range(3))  # (B, H, N, d)
    sram = int(costs.flash_sram_bytes(BLOCK, BLOCK, D, ELEM_BYTES))
    out = {}
    for name, (simulate_fn, model) in ALGORITHMS.items():
        kw = dict(Br=BLOCK, Bc=BLOCK, sram_bytes=sram, elem_bytes=ELEM_BYTES)
        out[name] = (simulate_fn(q, k, v, **kw), model(1, 1, 1, n, n, D, **kw))
    return out, (q, k, v), sram


def _layout(n_tiles):
    """Cell rectangles (x, y, w, h) of each tensor: S in the middle, Q left and O right along its rows, Kᵀ above
    and V below along its columns, the statistics beside O."""
    t = n_tiles
    boxes = {}
    for i in range(t):
        boxes[("Q", i, 0)] = (0, t - 1 - i, 1, 1)
        boxes[("O", i, 0)] = (t + 2.5, t - 1 - i, 1, 1)
        for x0, name in ((t + 3.7, "l"), (t + 4.1, "m"), (t + 4.5, "lse")):
            boxes[(name, i, 0)] = (x0, t - 1 - i, 0.3, 1)
        boxes[("K", i, 0)] = (1.5 + i, t + 0.5, 1, 1)
        boxes[("V", i, 0)] = (1.5 + i, -1.5, 1, 1)
        for j in range(t):
            boxes[("S", i, j)] = (1.5 + j, t - 1 - i, 1, 1)
    return boxes


def animate(path, name, frame_list, n_tiles, bar_limit, fps=4):
    """Write the frames as an animated GIF (matplotlib's PillowWriter): tiles on the left, bytes per tensor right."""
    from matplotlib.animation import PillowWriter
    from matplotlib.patches import Rectangle

    from ..report.charts import TENSOR_COLORS, figure, plt

    colors = {**TENSOR_COLORS, "l": "#999999", "m": "#999999", "lse": "#999999"}
    fig, axes = figure(ncols=2, width=3.0, height=2.8)
    grid, bars = axes[0, 0], axes[0, 1]
    patches = {}
    for cell, (x, y, w, h) in _layout(n_tiles).items():
        patches[cell] = grid.add_patch(Rectangle((x, y), w, h, facecolor="white", edgecolor="#bbbbbb", lw=0.5))
    t = n_tiles
    for x, y, label in ((0.5, t + 0.3, "Q"), (t + 3.0, t + 0.3, "O"), (t + 4.3, -0.6, "l m lse"),
                        (1.5 + t / 2, t + 1.7, "Kᵀ"), (1.5 + t / 2, -2.2, "V"), (1.5 + t / 2, t / 2, "S / P")):
        grid.text(x, y, label, ha="center", va="center", fontsize=7, zorder=3,
                  bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7, "pad": 0.5})
    grid.set_xlim(-0.3, t + 5.0)
    grid.set_ylim(-2.6, t + 2.0)
    grid.set_aspect("equal")
    grid.axis("off")
    title = fig.suptitle("", fontsize=8)
    tensors = [x for x in BAR_TENSORS if any(x in f.moved for f in frame_list)]
    rects = bars.barh(range(len(tensors)), [0] * len(tensors), color=[colors[x] for x in tensors])
    bars.set_yticks(range(len(tensors)), tensors, fontsize=7)
    bars.invert_yaxis()
    bars.set_xlim(0, bar_limit / 1e3)
    bars.set_xlabel("HBM kB moved (read + write)", fontsize=7)
    bars.tick_params(labelsize=6)
    writer = PillowWriter(fps=fps)
    with writer.saving(fig, str(path), dpi=64):
        for number, frame in enumerate(frame_list, 1):
            for (tensor, i, j), patch in patches.items():
                tile_tensor = "P" if tensor == "S" and frame.kernel == "pv" else tensor
                held = (i, j) in frame.on_chip.get(tile_tensor, ()) or (i, j) in frame.on_chip.get(tensor, ())
                patch.set_facecolor(colors[tile_tensor] if held else "white")
                edge = ("tab:red" if (tensor, i, j) in frame.stored or ("P", i, j) in frame.stored and tensor == "S"
                        else "tab:green" if (tile_tensor, i, j) in frame.loaded else "#bbbbbb")
                patch.set_edgecolor(edge)
                patch.set_linewidth(0.5 if edge == "#bbbbbb" else 1.6)
            for rect, tensor in zip(rects, tensors):
                rect.set_width(frame.moved.get(tensor, 0) / 1e3)
            total = sum(frame.moved.values())
            title.set_text(f"{LABELS[name]}, kernel {frame.kernel}: step {number}/{len(frame_list)}, "
                           f"{total / 1e3:.1f} kB; SRAM {frame.sram_used} B")
            writer.grab_frame()
    plt.close(fig)


def _summary_chart(path, results):
    from ..report.charts import ALGO_COLORS, figure, save

    fig, axes = figure(width=6.0, height=3.0)
    ax = axes[0, 0]
    tensors = [x for x in BAR_TENSORS if any(x in r.machine.reads or x in r.machine.writes
                                             for r, _ in results.values())]
    width = 0.8 / len(results)
    for a, (name, (result, _)) in enumerate(results.items()):
        moved = [(result.machine.reads.get(t, 0) + result.machine.writes.get(t, 0)) / 1e3 for t in tensors]
        ax.bar(np.arange(len(tensors)) + (a - 1) * width, moved, width, color=ALGO_COLORS[name], label=LABELS[name])
    ax.set_xticks(range(len(tensors)), tensors)
    ax.set_ylabel("HBM kB (read + write)")
    ax.legend(fontsize=8)
    save(fig, path)


def run(lesson, *, seed=0, tile=8):
    results, (q, k, v), sram = simulate(seed, tile)
    n = q.shape[2]
    oracle = reference(q, k, v)  # (1, 1, N, d), float64
    lesson.say(f"One head, N = {n} queries and keys, d = {D}, fp16 tensors and float32 statistics, tiles of "
               f"Br = Bc = {BLOCK} rows: {tile} × {tile} tiles. SRAM: {sram} bytes, the working set of one flash "
               f"step as `simulator.costs.flash_sram_bytes` gives it. Each schedule runs on the tile simulator "
               f"(`simulator.tiles`), which refuses to overflow the SRAM and counts every byte per tensor.")
    lesson.say("These are the two-level counts (HBM ↔ SRAM). The shared-cache (L2) level of the cost model is "
               "separate work (issue 16); once it lands, the DRAM bytes belong beside these.")
    rows = []
    replays = {}
    for name, (result, cost) in results.items():
        replays[name] = frames(result.machine.timeline, BLOCK)
        mach = result.machine
        tensors = sorted(set(mach.reads) | set(mach.writes), key=BAR_TENSORS.index)
        for t in tensors:
            sim = mach.reads.get(t, 0) + mach.writes.get(t, 0)
            model = int(cost.reads.get(t, 0)) + int(cost.writes.get(t, 0))
            rows.append([LABELS[name], t, f"{sim:,}", f"{model:,}", "yes" if sim == model else "**no**"])
        rows.append([LABELS[name], "**total**", f"{mach.hbm_read_bytes + mach.hbm_write_bytes:,}",
                     f"{int(cost.hbm_bytes):,}", "yes" if mach.hbm_read_bytes + mach.hbm_write_bytes ==
                     int(cost.hbm_bytes) else "**no**"])
    lesson.heading("Bytes per tensor: the simulator against the cost model")
    lesson.table(["algorithm", "tensor", "simulator bytes", "cost model bytes", "equal"], rows)
    totals = {name: r.machine.hbm_read_bytes + r.machine.hbm_write_bytes for name, (r, _) in results.items()}
    lesson.say(f"Standard attention writes S and reads it back, then writes P and reads it back: "
               f"{totals['standard']:,} bytes. FlashAttention-1 keeps K_j, V_j on chip and streams every query "
               f"block past them, loading and storing O, l, m each time: {totals['flash1']:,} bytes. "
               f"FlashAttention-2 keeps Q_i and its accumulator on chip and streams K, V: {totals['flash2']:,} "
               f"bytes, {num(totals['standard'] / totals['flash2'])}× less than standard here.")
    hw = load(REAL_HARDWARE)
    real = {name: model(1, REAL_HEADS, REAL_HEADS, REAL_N, REAL_N, REAL_D, sram_bytes=hw.sram_per_sm_bytes)
            for name, (_, model) in ALGORITHMS.items()}
    std = results["standard"][0].machine
    s_p, qkv = (sum(std.reads.get(t, 0) + std.writes.get(t, 0) for t in names) for names in ("SP", "QKV"))
    verdict = f"N = {n} is too short for the N² tensors to dominate" if s_p < qkv else "the N² tensors lead"
    lesson.say(f"At this toy size standard attention moves {s_p:,} bytes of S and P against {qkv:,} of Q, K and V: "
               f"{verdict}. At a real size, N = {REAL_N}, d = {REAL_D}, {REAL_HEADS} heads, with the tiles that fit "
               f"{hw.name}'s {hw.sram_per_sm_bytes / 1024:.0f} KiB of SRAM per SM, the cost model gives:")
    lesson.table(["algorithm", "HBM MB", "of which S and P", "predicted µs on " + hw.name],
                 [[LABELS[name], f"{float(c.hbm_bytes) / 1e6:,.1f}",
                   f"{(sum(float(c.reads.get(t, 0)) + float(c.writes.get(t, 0)) for t in 'SP')) / 1e6:,.1f}",
                   f"{float(c.time(hw).seconds) * 1e6:,.1f}"] for name, c in real.items()])
    lesson.heading("The schedules, step by step")
    lesson.table(["algorithm", "steps", "kernels", "SRAM peak bytes", "largest difference from the oracle"],
                 [[LABELS[name], len(replays[name]), len({f.kernel for f in replays[name]}),
                   f"{r.machine.sram_peak_bytes:,}", num(np.abs(r.output - oracle).max(), 2)]
                  for name, (r, _) in results.items()])
    lesson.say("In each frame a filled tile is in SRAM, a green edge was just loaded, a red edge just stored; the "
               "bars count the bytes moved so far. The last frame's bars are the totals above.")
    limit = max(max(f.moved.values()) for fr in replays.values() for f in fr[-1:])
    for name in results:
        lesson.chart(f"flash_tiles_{name}.gif", lambda p, name=name: animate(p, name, replays[name], tile, limit),
                     f"{LABELS[name]}, {len(replays[name])} steps")
    lesson.chart("flash_tiles_bytes.png", lambda p: _summary_chart(p, results),
                 "HBM bytes per tensor, standard vs FlashAttention-1 vs -2 (simulator = cost model)")

