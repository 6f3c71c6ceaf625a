"""What the reference scripts share: the recipes' AdamW (`recipe_adamw`), and the rank
plumbing: `--world N` runs a step function on N
processes of one thread each, joined by torch.distributed over gloo on this machine, and a
step's time is the slowest rank's. With `--rank R` this process is rank R alone, the others
started by hand (one per machine: MASTER_ADDR and MASTER_PORT name rank 0's, and
GLOO_SOCKET_IFNAME the interface to talk on), as `cargo xtask bench links` starts them.

    from torch_ranks import add_world_args, launch, join, slowest, leave, recipe_adamw
"""
import os

import torch


def recipe_adamw(model, lr):
    """kiln's recipes' AdamW: (0.9, 0.99), eps 1e-8, weight decay 0.1 on rank>=2 parameters."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.99), eps=1e-8,
    )


def add_world_args(ap, port):
    """`--world` (processes, one thread each when > 1) and `--port` on an argparse parser."""
    ap.add_argument("--world", type=int, default=1, help="processes (one thread each when > 1)")
    ap.add_argument("--port", type=int, default=port)
    ap.add_argument("--rank", type=int, default=None,
                    help="this process is rank R of --world alone (the others started apart)")


def launch(train, args):
    """`train(rank, args)` in this process (`--world 1`) or on `args.world` processes."""
    if args.batch % args.world:
        raise SystemExit(f"--batch {args.batch} is not a multiple of --world {args.world}")
    if args.rank is not None:
        if not 0 <= args.rank < args.world:
            raise SystemExit(f"--rank {args.rank} is not a rank of --world {args.world}")
        train(args.rank, args)
    elif args.world == 1:
        train(0, args)
    else:
        import torch.multiprocessing as mp

        mp.spawn(train, args=(args,), nprocs=args.world, join=True)


def join(rank, args):
    """Joins the process group when `--world` > 1 (one thread per rank, or `--threads`) and
    returns torch.distributed, else sets `--threads` if given and returns None."""
    if args.world == 1:
        if args.threads:
            torch.set_num_threads(args.threads)
        return None
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    torch.set_num_threads(args.threads or 1)
    return dist


def slowest(dist, elapsed):
    """The largest of every rank's `elapsed` seconds (`elapsed` itself in one process)."""
    if dist is None:
        return elapsed
    t = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def leave(dist):
    """Leaves the process group, if there is one, once every rank is done with it (a rank that
    tears its group down while another's last collective is in flight ends that one with
    "terminate called without an active exception")."""
    if dist is not None:
        dist.barrier()
        dist.destroy_process_group()
