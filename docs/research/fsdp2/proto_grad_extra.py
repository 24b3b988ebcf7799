"""Q3 extras (2-D dp=2 x tp=2, tiny transformer):
 a) zero_grad(set_to_none=False): FSDP2 then accumulates `grad._local_tensor += rs_out`.
    Unguarded ExtRS (RS output = the grad region itself) -> aliasing -> wrong.
    Guarded ExtRS (region only when grads are None) -> right, but then one add per step
    from a temporary RS output into the (external) grad.
 b) Adam(fused=True) on CPU with DTensor params and pre-created external state.
run (from the repository root): python docs/research/fsdp2/proto_grad_extra.py
"""

import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from common import (
    ExternalStore,
    batch,
    bitwise_equal,
    build,
    dp_rank,
    free_port,
    init_pg,
    local_shards,
    make_mesh,
)

CFG = "2d"


def run(mesh, ext, set_to_none, guard=True, fused=None, steps=4):
    model = build("tf", CFG, mesh)
    st = None
    if ext:
        st = ExternalStore(model)
        st.bind_params()
        st.bind_grads(guard=guard)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
    if ext:
        st.precreate_adam_state(opt)
    if not set_to_none:  # grads present from the start (as leto keeps them)
        from torch.distributed.tensor import DTensor

        for p in model.parameters():
            if not ext:
                p.grad = torch.zeros_like(p)
            else:  # grads = DTensor views of the external grad buffer, filled with -0.0
                fp, off, n = st.slots[id(p)]
                d = fp.fsdp_placement.dim
                v = st.region("grad", off, n, fp).narrow(d, 0, fp.sharded_size[d]).fill_(-0.0)
                p.grad = DTensor.from_local(
                    v,
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
    inside = True
    for s in range(steps):
        x, y = batch(s, dp_rank(CFG, mesh))
        F.mse_loss(model(x), y).backward()
        if ext:
            inside &= all(st.inside("grad", p.grad._local_tensor) for p in model.parameters())
        opt.step()
        if set_to_none or not ext:
            opt.zero_grad(set_to_none=set_to_none)
        else:  # leto-style: keep the views, fill -0.0 (exact identity of +)
            for p in model.parameters():
                p.grad._local_tensor.fill_(-0.0)
    return local_shards(model), inside


def worker(rank, world, port, q):
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    init_pg(rank, world, port)
    mesh = make_mesh(CFG)
    res = {}
    ref, _ = run(mesh, False, False)
    for guard in (False, True):
        got, inside = run(mesh, True, False, guard=guard)
        res[f"set_to_none=False guard={guard}"] = (
            all(bitwise_equal(ref[k], got[k]) for k in ref),
            inside,
        )
    try:
        ref, _ = run(mesh, False, True, fused=True)
        got, inside = run(mesh, True, True, fused=True)
        res["Adam fused=True"] = (all(bitwise_equal(ref[k], got[k]) for k in ref), inside)
    except Exception as e:
        res["Adam fused=True"] = f"ERROR {type(e).__name__}: {str(e)[:200]}"
    dist.destroy_process_group()
    q.put((rank, res))


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    ps = [ctx.Process(target=worker, args=(r, 4, port, q)) for r in range(4)]
    [p.start() for p in ps]
    res = dict(q.get(timeout=600) for _ in range(4))
    [p.join() for p in ps]
    for k in res[0]:
        print(
            f"{k}: (bitwise_equal_to_plain, grads_inside_ext_buffer) per rank = {[res[r][k] for r in range(4)]}"
        )
