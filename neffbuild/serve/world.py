"""The world part: one process, or the bundle's tp x dp ranks (``--dp N`` for an unsharded bundle).

``run_world`` starts ``world`` gloo processes (serve/procs.py: forked from a fork server, torch imported
once) in ``dp`` DP groups of ``world/dp`` consecutive ranks; DP group ``g`` owns ``requests[g::dp]``
(each of its TP ranks serves them together). Every rank writes its outcome to a file; the first rank
that failed with a neffbuild error is the cause the caller sees (exit 2 for the user's input, else 1).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from neffbuild.errors import InvalidInput, NeffbuildError
from neffbuild.runtime.bundle.facts import BundleFacts
from neffbuild.runtime.bundle.reader import read_facts
from neffbuild.serve import procs
from neffbuild.serve.parts import Request
from neffbuild.serve.run import Options, serve_rank

MAX_LOCAL_WORLD = 16


def world_for(facts: BundleFacts | None, dp_flag: int | None) -> tuple[int, int]:
    """(world size, dp) to run: a sharded bundle's own tp x dp; else --dp (default: the recipe's dp). ``facts``:
    the bundle's, read once by the caller (None: broken)."""
    if facts is None:  # broken: the ranks' open_bundle names what is wrong (exit 1)
        return dp_flag or 1, dp_flag or 1
    if not facts.sharded:  # unsharded: the same graph serves any number of DP ranks
        dp = dp_flag or facts.parallel.dp
        return dp, dp
    par = facts.parallel
    world, dp = par.world_size, par.dp
    if dp_flag not in (None, dp):
        raise InvalidInput(f"--dp {dp_flag}: this bundle was compiled for dp {dp} (tp {par.tp}, ep {par.ep}); "
                           "drop --dp or rebuild with parallel.dp set")
    if world > MAX_LOCAL_WORLD:
        raise InvalidInput(f"the bundle needs {world} ranks; generate runs every rank on this host (at most "
                           f"{MAX_LOCAL_WORLD}); serve it with the runtime API on a cluster instead")
    return world, dp


def _rank_worker(rank: int, env: dict[str, str], world: int, dp: int, init_file: str, bundle_path: str,
                 requests: list[Request], opts: Options, addresses, out_dir: str):
    import torch.distributed as dist

    procs.adopt_environment(env)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    dp_rank = rank // (world // dp)  # the ranks of one DP group are consecutive (runtime/parallel.py)
    try:
        prefill = (addresses, None) if addresses is not None else None
        res = serve_rank(bundle_path, requests[dp_rank::dp], opts, group=dist.group.WORLD, prefill=prefill)
        res.update(rank=rank, dp_rank=dp_rank)
    except NeffbuildError as exc:  # the real cause: written before the peers see a closed connection
        res = {"rank": rank, "error": str(exc), "exit_code": exc.exit_code, "cause": True}
    except Exception as exc:
        res = {"rank": rank, "error": f"{type(exc).__name__}: {str(exc)[:300]}", "exit_code": 1, "cause": False}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))


def run_world(bundle_path: str, requests: list[Request], opts: Options, world: int, dp: int,
              addresses=None) -> list[dict]:
    """Every rank's answer (serve_rank's dict plus rank and dp_rank), rank order; the first cause raised."""
    import torch.multiprocessing as mp

    procs.context()
    with tempfile.TemporaryDirectory(prefix="neffbuild-ranks-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        try:
            mp.start_processes(_rank_worker, args=(procs.caller_environment(), world, dp, init_file, bundle_path,
                                                   requests, opts, addresses, tmp),
                               nprocs=world, join=True, start_method=procs.START_METHOD)
        except mp.ProcessRaisedException:
            pass  # every rank writes its outcome; the cause is read below
        except mp.ProcessExitedException as exc:
            raise NeffbuildError(f"{world} ranks: a rank died ({exc}); no result") from None
        files = [Path(tmp, f"rank{r}.json") for r in range(world)]
        ranks = [json.loads(f.read_text()) for f in files if f.is_file()]
    causes = [r for r in ranks if r.get("cause")] or [r for r in ranks if "error" in r]
    if causes or len(ranks) < world:
        first = causes[0] if causes else {"rank": "?", "error": "a rank wrote no result", "exit_code": 1}
        err = InvalidInput if first.get("exit_code") == 2 else NeffbuildError
        raise err(f"rank {first['rank']}: {first['error']}")
    return ranks


def run_ranks(bundle_path: str, requests: list[Request], opts: Options, prefill_group=None,
              world: tuple[int, int] | None = None) -> list[dict]:
    """This bundle's world for ``opts``: one process (in this one) or spawned ranks; ``prefill_group``: DI's;
    ``world``: (size, dp) as ``world_for`` gave the caller (else read here)."""
    world, dp = world or world_for(read_facts(bundle_path, strict=False), opts.dp)
    addresses = prefill_group.addresses if prefill_group is not None else None
    if world == 1:
        prefill = (addresses, prefill_group.alive) if prefill_group is not None else None
        return [dict(serve_rank(bundle_path, requests, opts, prefill=prefill), rank=0, dp_rank=0)]
    return run_world(bundle_path, requests, opts, world, dp, addresses)
