"""Q4: after destroy_process_group + init_process_group (new store, new groups) and a
new DeviceMesh, point the EXISTING FSDP2/TP model (no re-wrap) at the new groups.

Two scenarios:
  same  : the new mesh is created in the same order as before -> c10d group names
          restart at "0" (destroy resets _world.group_count) and coincide with the old
          names; only FSDP's cached ProcessGroup objects must be refreshed.
  shift : an extra group is created first, so the new mesh's group names differ;
          the old DeviceMesh objects' _dim_group_names must be rewritten too.
Each: reference = 6 uninterrupted steps; test = 3 steps, regroup, 3 steps, on a model
whose params/grads/Adam state are views into external memfd buffers (common.py).
Checks: bitwise-equal local shards + Adam state vs reference, views intact, and the
model really uses the new ProcessGroup objects.

run (from the repository root): python docs/research/fsdp2/proto_regroup.py
"""

import gc
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import (
    ExternalStore,
    bitwise_equal,
    build,
    free_port,
    fsdp_param_groups,
    init_pg,
    local_shards,
    make_mesh,
    train,
)
from torch.distributed.device_mesh import DeviceMesh

CFG = "2d"


MODE = sys.argv[1] if len(sys.argv) > 1 else "full"  # full | no_fsdp_refresh | no_mesh_rename


def regroup(model, new_root: DeviceMesh) -> dict:
    """Point every live DeviceMesh of the old world at the new groups, then refresh
    FSDP2's cached groups.  PRIVATE: DeviceMesh._dim_group_names, ._pg_registry,
    ._flatten_mapping; FSDPParamGroup.mesh_info / post_forward_mesh_info and their
    shard_process_group / replicate_process_group / reduce_scatter_process_group
    (+ FSDPParam.mesh_info, the same objects)."""
    names = {d: new_root[d]._dim_group_names[0] for d in new_root.mesh_dim_names}
    new_pg = {n: dist.distributed_c10d._resolve_process_group(n) for n in names.values()}
    changed = 0
    for obj in gc.get_objects():
        if MODE == "no_mesh_rename":
            break
        if isinstance(obj, DeviceMesh) and obj is not new_root and hasattr(obj, "_dim_group_names"):
            dims = obj.mesh_dim_names
            want = [names[d] for d in dims]
            if obj._dim_group_names != want:
                changed += 1
            obj._dim_group_names = want
            reg = obj._pg_registry if obj._root_mesh is None else obj._root_mesh._pg_registry
            reg.clear()
            reg.update({n: new_pg[n] for n in want})
    infos = set()
    for _, g in fsdp_param_groups(model) if MODE != "no_fsdp_refresh" else []:
        for mi in [g.mesh_info, g.post_forward_mesh_info] + [fp.mesh_info for fp in g.fsdp_params]:
            if mi is not None and id(mi) not in infos:
                infos.add(id(mi))
                if getattr(mi, "shard_mesh_dim", None) is not None:
                    mi.shard_process_group = mi.mesh.get_group(mi.shard_mesh_dim)
                    mi.reduce_scatter_process_group = (
                        None  # only set by set_separate_reduce_scatter_group
                    )
                if getattr(mi, "replicate_mesh_dim", None) is not None:
                    mi.replicate_process_group = mi.mesh.get_group(mi.replicate_mesh_dim)
    return {"meshes_renamed": changed, "mesh_infos": len(infos)}


def uses_new_groups(model, new_root) -> bool:
    new = {new_root[d].get_group() for d in new_root.mesh_dim_names}
    ok = True
    for _, g in fsdp_param_groups(model):
        ok &= g.mesh_info.shard_process_group in new
    for p in model.parameters():
        m = p.device_mesh
        ok &= all(m.get_group(i) in new for i in range(m.ndim))
    return ok


def worker(rank, world, ports, q):
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = {}
    for scenario, (pa, pb) in zip(("same", "shift"), ports, strict=True):
        init_pg(rank, world, pa, timeout_s=30)
        mesh = make_mesh(CFG)
        # reference: 6 uninterrupted steps
        ref = build("tf", CFG, mesh)
        ropt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        train(ref, ropt, CFG, mesh, 6)
        # test: external buffers, 3 steps, new world, 3 steps
        model = build("tf", CFG, mesh)
        st = ExternalStore(model)
        st.bind_params()
        st.bind_grads()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        st.precreate_adam_state(opt)
        train(model, opt, CFG, mesh, 3)
        old_names = list(mesh._dim_group_names)
        old_pgs = {mesh["dp"].get_group(), mesh["tp"].get_group()}

        dist.destroy_process_group()  # every group of the old world is gone
        init_pg(rank, world, pb, timeout_s=30)  # new store, new default group
        if scenario == "shift":
            dist.new_group([0, 1, 2, 3])  # shifts the generated group names
        new_mesh = make_mesh(CFG)
        info = regroup(model, new_mesh)
        info["old_names"], info["new_names"] = old_names, list(new_mesh._dim_group_names)
        info["uses_new"] = uses_new_groups(model, new_mesh)
        info["old_pg_left"] = any(
            g.mesh_info.shard_process_group in old_pgs for _, g in fsdp_param_groups(model)
        )
        try:
            train(model, opt, CFG, new_mesh, 3, start=3)
            info["error"] = None
        except Exception as e:  # negative controls
            info["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            print(f"rank {rank} {scenario}: {info['error']}", flush=True)
            q.put((rank, {scenario: info}))
            return
        a, b = local_shards(ref), local_shards(model)
        info["params_bitwise"] = all(bitwise_equal(a[k], b[k]) for k in a)
        pr, pm = dict(ref.named_parameters()), dict(model.named_parameters())
        info["adam_bitwise"] = all(
            bitwise_equal(ropt.state[pr[k]][s]._local_tensor, opt.state[pm[k]][s]._local_tensor)
            for k in pr
            for s in ("exp_avg", "exp_avg_sq")
        )
        v = st.check_views(opt)
        info["views"] = v["param"] and v["state"]
        out[scenario] = info
        dist.barrier()
        dist.destroy_process_group()
    q.put((rank, out))


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = [(free_port(), free_port()), (free_port(), free_port())]
    procs = [ctx.Process(target=worker, args=(r, 4, ports, q)) for r in range(4)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=600) for _ in range(4))
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    if any(
        res[r].get("same", {}).get("error")
        or res[r].get("shift", {}).get("error")
        or len(res[r]) < 2
        for r in range(4)
    ):
        print(
            "mode",
            MODE,
            "-> ERROR in training after regroup:",
            {r: {k: v.get("error") for k, v in res[r].items()} for r in range(4)},
        )
        sys.exit(1)
    ok = True
    for sc in ("same", "shift"):
        per = [res[r][sc] for r in range(4)]
        good = all(
            i["params_bitwise"]
            and i["adam_bitwise"]
            and i["views"]
            and i["uses_new"]
            and not i["old_pg_left"]
            for i in per
        )
        ok &= good
        i = per[0]
        print(
            f"{sc:5s}: {'OK' if good else 'FAIL'}  old names {i['old_names']} new names {i['new_names']} "
            f"meshes renamed={i['meshes_renamed']} mesh_infos refreshed={i['mesh_infos']} uses_new={i['uses_new']} "
            f"params_bitwise={[x['params_bitwise'] for x in per]} adam_bitwise={[x['adam_bitwise'] for x in per]} views={[x['views'] for x in per]}"
        )
    print("mode", MODE, "ALL OK" if ok else "SOME FAILED")
    sys.exit(0 if ok else 1)
