"""Which K to serve at which load: the recommendation of an eval sweep.

For each draft and concurrency, the K whose speedup over no draft (the mean over the
prompt sets, each against its own baseline at that concurrency) is highest, or "no draft"
when no K beats 1.0; with the ``--speculative-config`` JSON that serves it in
``vllm serve`` (P-EAGLE: ``eagle3`` with ``parallel_drafting``). A server measured by
``eval --server`` drafts at its own K, with a draft eval cannot name: its line says whether
that K pays, against the no-draft server.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

__all__ = ["format_recommendation", "recommend", "speculative_config"]


def speculative_config(draft: str, k: int) -> dict:
    """vLLM's speculative config for a P-EAGLE draft at K (never sequential drafting)."""
    return {
        "method": "eagle3",
        "model": draft,
        "num_speculative_tokens": k,
        "parallel_drafting": True,
    }


def recommend(runs: Sequence[dict]) -> list[dict]:
    """Per draft and concurrency: the best K, its speedup and its serving config.

    Args:
        runs: the record's runs, with ``speedup`` filled in (``compare_with_baseline``).

    Returns ``[{"draft", "label", "concurrency", "k", "speedup", "speculative_config"}]``
    (and ``"server"``, its URL, for a server's runs, whose ``speculative_config`` is None);
    ``k`` and ``speculative_config`` are None ("no draft") when no K has a speedup > 1.
    Example: speedups K=2: 1.4x, K=4: 1.2x at c=1 and 0.6x, 0.4x at c=16 -> K=2 at c=1,
    no draft at c=16.
    """
    cells: dict[tuple, dict[int, list[float]]] = {}
    for r in runs:
        if r["k"] and r.get("speedup"):
            key = (r["draft"], r.get("server"), r["label"], r.get("concurrency"))
            cells.setdefault(key, {}).setdefault(r["k"], []).append(r["speedup"])
    out = []
    for (draft, server, label, concurrency), by_k in cells.items():
        mean = {k: sum(v) / len(v) for k, v in by_k.items()}
        best = max(sorted(mean), key=lambda k: mean[k])  # ties: the smaller K
        pays = mean[best] > 1.0
        out.append(
            {
                "draft": draft,
                "label": label,
                "concurrency": concurrency,
                "k": best if pays else None,
                "speedup": mean[best],
                "speedup_by_k": mean,
                "speculative_config": speculative_config(draft, best) if pays and draft else None,
                **({"server": server} if server else {}),
            }
        )
    return sorted(out, key=lambda r: (r["label"], r["concurrency"] or 0))


def format_recommendation(recommendations: Sequence[dict]) -> str:
    """The lines printed under the table: per draft and concurrency, what to serve."""
    lines = []
    for r in recommendations:
        head = f"{r['label']} at concurrency {r['concurrency']}: "
        if r.get("server"):
            (k,) = r["speedup_by_k"]
            pays = "pays" if r["k"] else "does not pay: serve without a draft"
            lines.append(head + f"its K={k} {pays} ({r['speedup']:.2f}x, {r['server']})")
        elif r["k"] is None:
            lines.append(head + f"no draft (best K reaches {r['speedup']:.2f}x)")
        else:
            config = json.dumps(r["speculative_config"])
            lines.append(
                head + f"K={r['k']} ({r['speedup']:.2f}x): "
                f"vllm serve <target> --speculative-config '{config}'"
            )
    return "recommendation (speedup over no draft, mean over prompt sets):\n" + "\n".join(
        "  " + line for line in lines
    )
