"""What a fetched remote entry's ``meta.json`` must record to be taken for a target (remote_tier.py, worker.py).

A pre-key record may point anywhere; an entry whose meta says it is another graph's, or another toolchain's,
is never taken for this one, under any key (docs/remote-cache.md "Trust").
"""

from __future__ import annotations

from neffbuild.compiler.jobs import Job


def expected_meta(job: Job, backend, input_signature=None):
    """``expect(meta)`` for a remote entry fetched for ``job``: why the meta records another toolchain, graph
    (a pre-key hit) or input signature (traced) than this target's (None: it records this one's). A pre-key
    record may point anywhere; an entry that says it is another graph's is never taken for this one."""
    from neffbuild.compiler.cache import canonical
    from neffbuild.compiler.graph_spec import graph_summary

    want = {"fingerprint": backend.fingerprint()}  # traced: the key covers the graph's text, so its inputs will do
    if input_signature is None:
        want["graph"] = graph_summary(job.graph)
    else:
        want["input_signature"] = input_signature

    def expect(meta: dict) -> str | None:
        for name, value in want.items():
            if canonical(meta.get(name)) != canonical(value):
                return f"records another {name} than this target's ({str(meta.get(name))[:120]})"
        return None

    return expect
