-------------------------------- MODULE Leto --------------------------------
(***************************************************************************)
(* leto: in-place recovery of distributed training, as an abstract model. *)
(* The contract is spec/PROTOCOL.md; spec/README.md explains the why.      *)
(*                                                                         *)
(* Theory of operation.                                                    *)
(*                                                                         *)
(* Each rank's model state (params + optimizer state) is retained outside *)
(* the trainer process, cut into NChunks chunks, plus one gradient block   *)
(* (this rank's reduced-gradient shard).  A chunk's value is the step      *)
(* whose bytes it holds, or TORN / LOST / GARBAGE.                         *)
(*                                                                         *)
(* One training step is a transaction over all ranks:                      *)
(*   Compute -> Reduce (collective) -> Prepare (gradients protected by     *)
(*   tier-1 parity, vote) -> Decide (COMMIT recorded in the agents' store) *)
(*   -> per chunk: BeginChunk (keep undo copy, chunk TORN) -> EndChunk     *)
(*   (new bytes) -> ParityChunk (parity updated, undo dropped) -> Finish   *)
(*   -> the loop tail (the user's code after optimizer.step(): scheduler,  *)
(*   scaler, logging) -> Close, at the next batch (the process state after *)
(*   the tail is kept by the node agent: the step's closed state).         *)
(* So at every instant each chunk can be produced, locally or from its    *)
(* node's parity, at the committed version V or at V-1 together with the   *)
(* gradients of V: recovery rolls forward to V (or drops an uncommitted   *)
(* V+1), never loses a committed step while failures stay inside tier 1.   *)
(*                                                                         *)
(* Tier 1: single parity per node over its ranks' chunks and gradients     *)
(* (rebuilds any one rank's lost memory).  Tier 2: a cross-node snapshot   *)
(* at step t2, at most K steps behind (survives one lost node).  Tier 3:   *)
(* the disk checkpoint at step ckpt: BeginCheckpoint (every rank idle at   *)
(* one step) -> WriteShard(r) per writer, asynchronously -> once every     *)
(* writer has finished, CheckpointDurable moves ckpt (the fallback step)   *)
(* forward.  A recovery aborts a checkpoint in progress.                   *)
(*                                                                         *)
(* Recovery: Detect -> Fence (bump the generation: writes of older         *)
(* generations are refused, hung trainers become stale processes) ->       *)
(* Promote (warm or cold shadows take the dead ranks) -> Reconcile (roll   *)
(* forward/back, repair from tier 1, else restore tier 2) or GoFallback -> *)
(* RestoreCheckpoint -> Rebuild (new process group) -> Resume.  A failure  *)
(* during recovery restarts it at a new generation.  Every recovery ends:  *)
(* it resumes or, when what it waits for never comes (a shadow), the       *)
(* recovery deadline fails the job (GiveUp, phase FAILED; BoundedSpec and  *)
(* Liveness).                                                              *)
(*                                                                         *)
(* Constant Mutant switches in one deliberately broken variant (see the    *)
(* table at the end of PROTOCOL.md); "none" is the protocol itself.        *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets

CONSTANTS
    Ranks,      \* trainer ranks
    Nodes,      \* hosts
    NodeOf,     \* rank -> node
    NChunks,    \* chunks per rank's retained state
    MaxStep,    \* training stops at this step
    MaxFaults,  \* faults injected in one behaviour
    K,          \* tier 2 lags at most K steps
    T2Parity,   \* tier 2's cross-node parities: lost nodes the snapshot survives
    Mutant,     \* "none" or the name of a broken variant
    NONE, TORN, LOST, GARBAGE   \* model values

Mutants == {"none", "no_undo", "early_commit", "no_fencing", "parity_first",
            "stale_shadow", "no_timeout", "early_durable", "stale_tail"}

ASSUME /\ Ranks # {} /\ Nodes # {}
       /\ NodeOf \in [Ranks -> Nodes]
       /\ NChunks \in Nat \ {0} /\ MaxStep \in Nat /\ MaxFaults \in Nat
       /\ K \in Nat \ {0}
       /\ T2Parity \in Nat \ {0}
       /\ Mutant \in Mutants

VARIABLES
    trainer,      \* rank -> ALIVE | DEAD | HUNG
    tgen,         \* rank -> generation its trainer was admitted in
    pc,           \* rank -> IDLE | COMPUTED | REDUCED | PREPARED | APPLYING | TAIL
    step,         \* rank -> step of the process state
    tail,         \* rank -> the step whose loop tail its process state includes
    data,         \* rank -> chunk -> step | TORN | LOST | GARBAGE
    undo,         \* rank -> chunk -> NONE | step
    grad,         \* rank -> NONE | LOST | step whose gradients it holds
    shadow,       \* rank -> NONE | COLD | WARM
    stale,        \* rank -> an old-generation process of it still exists
    par,          \* node -> chunk -> LOST | [members -> step encoded]
    gpar,         \* node -> LOST | [members -> NONE | step encoded]
    gen,          \* current generation
    phase,        \* coordinator phase
    committed,    \* last step whose COMMIT is recorded
    prepared,     \* ranks that voted for committed + 1
    faults,       \* faults injected so far
    t2,           \* step of the last complete tier-2 snapshot
    t2lost,       \* nodes whose tier-2 blocks were lost since
    target,       \* NONE or the step recovery resumes at
    kind,         \* what the last reconcile did
    loss,         \* committed steps the last reconcile gave up
    mlost,        \* ranks whose memory was lost since the last resume
    nlost,        \* nodes lost since the last resume
    promoted,     \* ranks promoted in the current recovery
    stale_writes, \* writes accepted from an old generation
    ckpt,         \* step of the latest durable disk checkpoint (the fallback)
    cpend,        \* NONE or the step of the checkpoint being written
    ckdone,       \* writers that finished their shard of cpend
    ckmiss        \* writers whose shard the durable checkpoint lacks

vars == <<trainer, tgen, pc, step, tail, data, undo, grad, shadow, stale, par, gpar,
          gen, phase, committed, prepared, faults, t2, t2lost, target, kind,
          loss, mlost, nlost, promoted, stale_writes, ckpt, cpend, ckdone,
          ckmiss>>
ckvars == <<ckpt, cpend, ckdone, ckmiss>>

-----------------------------------------------------------------------------
Steps == 0..MaxStep
Chunks == 1..NChunks
RanksOf(n) == {r \in Ranks : NodeOf[r] = n}
Phases == {"RUNNING", "FENCING", "PROMOTING", "RECONCILING", "FALLBACK",
           "REBUILDING", "RESUMING", "FAILED"}
Kinds == {"INPLACE", "FORWARD", "BACK", "TIER1", "TIER2", "CKPT"}

\* The keeper's fence: only the current generation's live trainer may act.
Active(r) == phase = "RUNNING" /\ trainer[r] = "ALIVE" /\ tgen[r] = gen

\* Parity that encodes version v for every member, for every node and chunk.
ParityAt(v) == [n \in Nodes |-> [c \in Chunks |-> [m \in RanksOf(n) |-> v]]]
NoGradParity == [n \in Nodes |-> [m \in RanksOf(n) |-> NONE]]

\* A chunk whose checksum holds: clean, written, or torn with its undo copy.
Intact(r, c) == data[r][c] \in Steps \/ (data[r][c] = TORN /\ undo[r][c] # NONE)

\* Every shadow at the start: warm.  (A trace of a real run, TraceLeto.tla,
\* starts with none, NONE: the agents start them with the trainers.)
InitShadow == "WARM"

Init ==
    /\ trainer = [r \in Ranks |-> "ALIVE"]
    /\ tgen = [r \in Ranks |-> 0]
    /\ pc = [r \in Ranks |-> "IDLE"]
    /\ step = [r \in Ranks |-> 0]
    /\ tail = [r \in Ranks |-> 0]
    /\ data = [r \in Ranks |-> [c \in Chunks |-> 0]]
    /\ undo = [r \in Ranks |-> [c \in Chunks |-> NONE]]
    /\ grad = [r \in Ranks |-> NONE]
    /\ shadow = [r \in Ranks |-> InitShadow]
    /\ stale = [r \in Ranks |-> FALSE]
    /\ par = ParityAt(0)
    /\ gpar = NoGradParity
    /\ gen = 0
    /\ phase = "RUNNING"
    /\ committed = 0
    /\ prepared = {}
    /\ faults = 0
    /\ t2 = 0
    /\ t2lost = {}
    /\ target = NONE
    /\ kind = NONE
    /\ loss = 0
    /\ mlost = {}
    /\ nlost = {}
    /\ promoted = {}
    /\ stale_writes = 0
    /\ ckpt = 0
    /\ cpend = NONE
    /\ ckdone = {}
    /\ ckmiss = {}

-----------------------------------------------------------------------------
(* Trainer: one step = compute, reduce, prepare, decide, apply, finish,    *)
(* then the loop tail until the step is closed.                            *)

\* IDLE: the step before is closed (its loop tail over, its process state kept).
Compute(r) ==
    /\ Active(r)
    /\ pc[r] = "IDLE"
    /\ step[r] < MaxStep
    /\ step[r] - t2 < K
    /\ pc' = [pc EXCEPT ![r] = "COMPUTED"]
    /\ UNCHANGED <<trainer, tgen, step, tail, data, undo, grad, shadow, stale, par,
                   gpar, gen, phase, committed, prepared, faults, t2, t2lost,
                   target, kind, loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

\* A collective: every rank must be in it, alive in this generation.
Reduce(r) ==
    /\ Active(r)
    /\ pc[r] = "COMPUTED"
    /\ \A q \in Ranks : /\ trainer[q] = "ALIVE" /\ tgen[q] = gen
                        /\ step[q] = step[r]
                        /\ pc[q] \in {"COMPUTED", "REDUCED", "PREPARED"}
    /\ grad' = [grad EXCEPT ![r] = step[r] + 1]
    /\ pc' = [pc EXCEPT ![r] = "REDUCED"]
    /\ UNCHANGED <<trainer, tgen, step, tail, data, undo, shadow, stale, par, gpar,
                   gen, phase, committed, prepared, faults, t2, t2lost,
                   target, kind, loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

\* PREPARE: the gradients are protected by tier-1 parity, then the vote.
Prepare(r) ==
    /\ Active(r)
    /\ pc[r] = "REDUCED"
    /\ gpar' = IF gpar[NodeOf[r]] = LOST THEN gpar
               ELSE [gpar EXCEPT ![NodeOf[r]][r] = grad[r]]
    /\ pc' = [pc EXCEPT ![r] = "PREPARED"]
    /\ prepared' = prepared \cup {r}
    /\ UNCHANGED <<trainer, tgen, step, tail, data, undo, grad, shadow, stale, par,
                   gen, phase, committed, faults, t2, t2lost, target, kind,
                   loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

\* DECIDE: COMMIT(committed+1) recorded in the agents' replicated store.
Decide ==
    /\ phase = "RUNNING"
    /\ IF Mutant = "early_commit" THEN prepared # {} ELSE prepared = Ranks
    /\ \A q \in prepared : grad[q] = committed + 1   \* every vote is for V+1
    /\ committed' = committed + 1
    /\ prepared' = {}
    /\ UNCHANGED <<trainer, tgen, pc, step, tail, data, undo, grad, shadow, stale,
                   par, gpar, gen, phase, faults, t2, t2lost, target, kind,
                   loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

\* APPLY, chunk by chunk, in order; the old bytes are kept as the undo copy.
BeginChunk(r, c) ==
    /\ Active(r)
    /\ pc[r] \in {"PREPARED", "APPLYING"}
    /\ committed = step[r] + 1
    /\ data[r][c] = step[r] /\ undo[r][c] = NONE
    /\ \A d \in 1..(c - 1) : data[r][d] = step[r] + 1 /\ undo[r][d] = NONE
    /\ undo' = [undo EXCEPT ![r][c] = data[r][c]]
    /\ data' = [data EXCEPT ![r][c] = TORN]
    /\ pc' = [pc EXCEPT ![r] = "APPLYING"]
    /\ UNCHANGED <<trainer, tgen, step, tail, grad, shadow, stale, par, gpar, gen,
                   phase, committed, prepared, faults, t2, t2lost, target,
                   kind, loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

EndChunk(r, c) ==
    /\ Active(r)
    /\ pc[r] = "APPLYING"
    /\ data[r][c] = TORN /\ undo[r][c] # NONE
    /\ data' = [data EXCEPT ![r][c] = step[r] + 1]
    /\ UNCHANGED <<trainer, tgen, pc, step, tail, undo, grad, shadow, stale, par,
                   gpar, gen, phase, committed, prepared, faults, t2, t2lost,
                   target, kind, loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

\* The node's parity is updated to the new bytes; only then is undo dropped.
\* (Mutant parity_first: the parity may also be written, once, while the chunk
\* is TORN; the undo copy is then kept.)
ParityChunk(r, c) ==
    /\ Active(r)
    /\ pc[r] = "APPLYING"
    /\ undo[r][c] # NONE
    /\ \/ data[r][c] = step[r] + 1
       \/ /\ Mutant = "parity_first" /\ data[r][c] = TORN
          /\ par[NodeOf[r]][c] # LOST => par[NodeOf[r]][c][r] # step[r] + 1
    /\ par' = IF par[NodeOf[r]][c] = LOST THEN par
              ELSE [par EXCEPT ![NodeOf[r]][c][r] = step[r] + 1]
    /\ undo' = IF data[r][c] = TORN THEN undo
               ELSE [undo EXCEPT ![r][c] = NONE]
    /\ UNCHANGED <<trainer, tgen, pc, step, tail, data, grad, shadow, stale, gpar,
                   gen, phase, committed, prepared, faults, t2, t2lost,
                   target, kind, loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

\* The optimizer step is done on this rank; the user's loop tail follows.
Finish(r) ==
    /\ Active(r)
    /\ pc[r] = "APPLYING"
    /\ \A c \in Chunks : data[r][c] = step[r] + 1 /\ undo[r][c] = NONE
    /\ step' = [step EXCEPT ![r] = step[r] + 1]
    /\ pc' = [pc EXCEPT ![r] = "TAIL"]
    /\ UNCHANGED <<trainer, tgen, tail, data, undo, grad, shadow, stale, par, gpar,
                   gen, phase, committed, prepared, faults, t2, t2lost,
                   target, kind, loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

\* The loop tail (scheduler.step(), scaler.update(), ...) ran: at the next batch
\* the rank's process state of step[r], after the tail, goes to its node agent,
\* which keeps it (the step's closed state).  The next step's Compute needs it.
Close(r) ==
    /\ Active(r)
    /\ pc[r] = "TAIL"
    /\ pc' = [pc EXCEPT ![r] = "IDLE"]
    /\ tail' = [tail EXCEPT ![r] = step[r]]
    /\ UNCHANGED <<trainer, tgen, step, data, undo, grad, shadow, stale, par,
                   gpar, gen, phase, committed, prepared, faults, t2, t2lost,
                   target, kind, loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

\* Tier 2: a complete cross-node snapshot, taken when every rank is idle
\* (closed: the snapshot holds each rank's closed process state).
Tier2Snapshot ==
    /\ phase = "RUNNING"
    /\ \E s \in Steps :
          /\ s > t2
          /\ \A r \in Ranks : /\ pc[r] = "IDLE" /\ step[r] = s
                              /\ \A c \in Chunks : data[r][c] = s
          /\ t2' = s
    /\ t2lost' = {}
    /\ UNCHANGED <<trainer, tgen, pc, step, tail, data, undo, grad, shadow, stale,
                   par, gpar, gen, phase, committed, prepared, faults, target,
                   kind, loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

\* Tier 3: a periodic disk checkpoint, taken when every rank is idle at one
\* step s past the durable one.  The writers stage their state and write it
\* in the background (training goes on); the checkpoint is durable only once
\* every writer has finished, and only then does the fallback step move.
BeginCheckpoint ==
    /\ phase = "RUNNING"
    /\ cpend = NONE
    /\ \E s \in Steps :
          /\ s > ckpt
          /\ \A r \in Ranks : /\ pc[r] = "IDLE" /\ step[r] = s
                              /\ \A c \in Chunks : data[r][c] = s
          /\ cpend' = s
    /\ ckdone' = {}
    /\ UNCHANGED <<trainer, tgen, pc, step, tail, data, undo, grad, shadow, stale,
                   par, gpar, gen, phase, committed, prepared, faults, t2,
                   t2lost, target, kind, loss, mlost, nlost, promoted,
                   stale_writes, ckpt, ckmiss>>

\* Writer r's shard of the checkpoint is written (a fenced writer's is not).
WriteShard(r) ==
    /\ Active(r)
    /\ cpend # NONE
    /\ r \notin ckdone
    /\ ckdone' = ckdone \cup {r}
    /\ UNCHANGED <<trainer, tgen, pc, step, tail, data, undo, grad, shadow, stale,
                   par, gpar, gen, phase, committed, prepared, faults, t2,
                   t2lost, target, kind, loss, mlost, nlost, promoted,
                   stale_writes, ckpt, cpend, ckmiss>>

\* (Mutant early_durable: one finished writer is enough; the others' shards
\* are then missing from the durable checkpoint.)
CheckpointDurable ==
    /\ phase = "RUNNING"
    /\ cpend # NONE
    /\ IF Mutant = "early_durable" THEN ckdone # {} ELSE ckdone = Ranks
    /\ ckpt' = cpend
    /\ ckmiss' = Ranks \ ckdone
    /\ cpend' = NONE
    /\ ckdone' = {}
    /\ UNCHANGED <<trainer, tgen, pc, step, tail, data, undo, grad, shadow, stale,
                   par, gpar, gen, phase, committed, prepared, faults, t2,
                   t2lost, target, kind, loss, mlost, nlost, promoted,
                   stale_writes>>

-----------------------------------------------------------------------------
(* Shadows (background).                                                   *)

ShadowWarm(r) ==
    /\ shadow[r] \in {NONE, "COLD"}
    /\ shadow' = [shadow EXCEPT ![r] = "WARM"]
    /\ UNCHANGED <<trainer, tgen, pc, step, tail, data, undo, grad, stale, par, gpar,
                   gen, phase, committed, prepared, faults, t2, t2lost,
                   target, kind, loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

ShadowReclaim(r) ==
    /\ shadow[r] = "WARM"
    /\ shadow' = [shadow EXCEPT ![r] = "COLD"]
    /\ UNCHANGED <<trainer, tgen, pc, step, tail, data, undo, grad, stale, par, gpar,
                   gen, phase, committed, prepared, faults, t2, t2lost,
                   target, kind, loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

-----------------------------------------------------------------------------
(* Faults: at most MaxFaults per behaviour, in every phase.                *)

FaultOK == faults < MaxFaults

Crash(r) ==
    /\ FaultOK
    /\ trainer[r] = "ALIVE"
    /\ trainer' = [trainer EXCEPT ![r] = "DEAD"]
    /\ faults' = faults + 1
    /\ UNCHANGED <<tgen, pc, step, tail, data, undo, grad, shadow, stale, par, gpar,
                   gen, phase, committed, prepared, t2, t2lost, target, kind,
                   loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

Hang(r) ==
    /\ FaultOK
    /\ trainer[r] = "ALIVE"
    /\ trainer' = [trainer EXCEPT ![r] = "HUNG"]
    /\ faults' = faults + 1
    /\ UNCHANGED <<tgen, pc, step, tail, data, undo, grad, shadow, stale, par, gpar,
                   gen, phase, committed, prepared, t2, t2lost, target, kind,
                   loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

\* A GPU reset or keeper crash: the rank's retained memory is gone, and the
\* trainer with it.
LoseMemory(r) ==
    /\ FaultOK
    /\ \E c \in Chunks : data[r][c] # LOST
    /\ data' = [data EXCEPT ![r] = [c \in Chunks |-> LOST]]
    /\ undo' = [undo EXCEPT ![r] = [c \in Chunks |-> NONE]]
    /\ grad' = [grad EXCEPT ![r] = LOST]
    /\ trainer' = [trainer EXCEPT ![r] = "DEAD"]
    /\ mlost' = mlost \cup {r}
    /\ faults' = faults + 1
    /\ UNCHANGED <<tgen, pc, step, tail, shadow, stale, par, gpar, gen, phase,
                   committed, prepared, t2, t2lost, target, kind, loss, nlost,
                   promoted, stale_writes>>
    /\ UNCHANGED ckvars

\* A whole host is lost (replaced by a spare with empty memory).
LoseNode(n) ==
    /\ FaultOK
    /\ n \notin nlost          \* not twice in one recovery
    /\ LET on == RanksOf(n) IN
       /\ data' = [r \in Ranks |-> IF r \in on THEN [c \in Chunks |-> LOST]
                                   ELSE data[r]]
       /\ undo' = [r \in Ranks |-> IF r \in on THEN [c \in Chunks |-> NONE]
                                   ELSE undo[r]]
       /\ grad' = [r \in Ranks |-> IF r \in on THEN LOST ELSE grad[r]]
       /\ trainer' = [r \in Ranks |-> IF r \in on THEN "DEAD" ELSE trainer[r]]
       /\ shadow' = [r \in Ranks |-> IF r \in on THEN NONE ELSE shadow[r]]
       /\ stale' = [r \in Ranks |-> IF r \in on THEN FALSE ELSE stale[r]]
       /\ mlost' = mlost \cup on
    /\ par' = [par EXCEPT ![n] = [c \in Chunks |-> LOST]]
    /\ gpar' = [gpar EXCEPT ![n] = LOST]
    /\ t2lost' = t2lost \cup {n}
    /\ nlost' = nlost \cup {n}
    /\ faults' = faults + 1
    /\ UNCHANGED <<tgen, pc, step, tail, gen, phase, committed, prepared, t2,
                   target, kind, loss, promoted, stale_writes>>
    /\ UNCHANGED ckvars

-----------------------------------------------------------------------------
(* Fencing: an old-generation process tries to write chunk c.              *)

\* The keeper refuses it and the agent kills the process.  (Mutant no_fencing:
\* the write to an intact chunk is accepted and leaves bytes of no step.)
StaleWrite(r, c) ==
    /\ stale[r]
    /\ stale' = [stale EXCEPT ![r] = FALSE]
    /\ IF Mutant = "no_fencing" /\ Intact(r, c)
          THEN /\ data' = [data EXCEPT ![r][c] = GARBAGE]
               /\ undo' = [undo EXCEPT ![r][c] = NONE]
               /\ stale_writes' = stale_writes + 1
          ELSE UNCHANGED <<data, undo, stale_writes>>
    /\ UNCHANGED <<trainer, tgen, pc, step, tail, grad, shadow, par, gpar, gen,
                   phase, committed, prepared, faults, t2, t2lost, target,
                   kind, loss, mlost, nlost, promoted>>
    /\ UNCHANGED ckvars

-----------------------------------------------------------------------------
(* Coordinator: recovery.                                                  *)

\* In FENCING the coming fence covers a new failure; in PROMOTING a dead rank
\* is one more rank to promote, but a hung one must be fenced first.
Detect ==
    \/ /\ phase \in {"RUNNING", "RECONCILING", "FALLBACK", "REBUILDING",
                     "RESUMING"}
       /\ \E r \in Ranks : trainer[r] \in {"DEAD", "HUNG"}
    \/ /\ phase = "PROMOTING"
       /\ \E r \in Ranks : trainer[r] = "HUNG"
    /\ phase' = "FENCING"
    /\ UNCHANGED <<trainer, tgen, pc, step, tail, data, undo, grad, shadow, stale,
                   par, gpar, gen, committed, prepared, faults, t2, t2lost,
                   target, kind, loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

Fence ==
    /\ phase = "FENCING"
    /\ gen' = gen + 1
    /\ prepared' = {}
    /\ trainer' = [r \in Ranks |-> IF trainer[r] = "HUNG" THEN "DEAD"
                                   ELSE trainer[r]]
    /\ stale' = [r \in Ranks |-> stale[r] \/ trainer[r] = "HUNG"]
    /\ phase' = "PROMOTING"
    \* a checkpoint in progress is aborted: its writers are fenced
    /\ cpend' = NONE
    /\ ckdone' = {}
    /\ UNCHANGED <<tgen, pc, step, tail, data, undo, grad, shadow, par, gpar,
                   committed, faults, t2, t2lost, target, kind, loss, mlost,
                   nlost, promoted, stale_writes, ckpt, ckmiss>>

Promote(r) ==
    /\ phase = "PROMOTING"
    /\ trainer[r] = "DEAD"
    /\ shadow[r] \in {"WARM", "COLD"}
    /\ trainer' = [trainer EXCEPT ![r] = "ALIVE"]
    /\ tgen' = [tgen EXCEPT ![r] = gen]
    /\ pc' = [pc EXCEPT ![r] = "IDLE"]
    /\ shadow' = [shadow EXCEPT ![r] = NONE]
    /\ promoted' = promoted \cup {r}
    /\ UNCHANGED <<step, tail, data, undo, grad, stale, par, gpar, gen, phase,
                   committed, prepared, faults, t2, t2lost, target, kind,
                   loss, mlost, nlost, stale_writes>>
    /\ UNCHANGED ckvars

EndPromote ==
    /\ phase = "PROMOTING"
    /\ \A r \in Ranks : trainer[r] = "ALIVE"
    /\ phase' = "RECONCILING"
    /\ UNCHANGED <<trainer, tgen, pc, step, tail, data, undo, grad, shadow, stale,
                   par, gpar, gen, committed, prepared, faults, t2, t2lost,
                   target, kind, loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

(* The reconcile plan.  V is the committed step.                           *)
V == committed

\* Versions of chunk c that rank r can produce from its own memory.
Local(r, c) ==
    LET d == data[r][c]
        u == undo[r][c]
    IN  IF d \in Steps THEN {d} \cup (IF u = NONE THEN {} ELSE {u})
        ELSE IF d = TORN /\ u # NONE THEN {u}
        ELSE {}

\* Version tier 1 rebuilds a missing chunk at (single parity per node).
Tier1(r, c) ==
    LET n == NodeOf[r] IN
    IF /\ par[n][c] # LOST
       /\ \A m \in RanksOf(n) \ {r} : par[n][c][m] \in Local(m, c)
    THEN {par[n][c][r]} ELSE {}

Avail(r, c) == IF Local(r, c) # {} THEN Local(r, c) ELSE Tier1(r, c)
FromTier1(r, c) == Local(r, c) = {} /\ Tier1(r, c) # {}

\* Gradients of step V for rank r: locally, or rebuilt from tier 1.
LocalGrad(r) == grad[r] = V
Tier1Grad(r) ==
    LET n == NodeOf[r] IN
    /\ grad[r] = LOST
    /\ gpar[n] # LOST
    /\ gpar[n][r] = V
    /\ \A m \in RanksOf(n) \ {r} : grad[m] = gpar[n][m]

RollsForward(r, c) ==
    /\ V \notin Avail(r, c)
    /\ V > 0 /\ (V - 1) \in Avail(r, c)
    /\ LocalGrad(r) \/ Tier1Grad(r)
Reaches(r, c) == V \in Avail(r, c) \/ RollsForward(r, c)
AllReach == \A r \in Ranks, c \in Chunks : Reaches(r, c)

UsedTier1 == \E r \in Ranks, c \in Chunks :
                 FromTier1(r, c) \/ (RollsForward(r, c) /\ ~LocalGrad(r))
Forward == \E r \in Ranks, c \in Chunks : RollsForward(r, c)
\* Reduced or prepared gradients of the uncommitted step V+1 are dropped.
Dropped == \E r \in Ranks : grad[r] = V + 1

\* Single parity across nodes: the snapshot survives one lost node (and none
\* in a one-node job, whose snapshot has no other node to live on).
\* The snapshot survives T2Parity lost nodes, and never all of them (a lost
\* node's share lives on another node).
T2Survives == IF Cardinality(Nodes) > T2Parity THEN T2Parity ELSE Cardinality(Nodes) - 1
T2Intact == Cardinality(t2lost) <= T2Survives

PlanKind ==
    IF AllReach THEN
        IF UsedTier1 THEN "TIER1"
        ELSE IF Forward THEN "FORWARD"
        ELSE IF Dropped THEN "BACK"
        ELSE "INPLACE"
    ELSE IF T2Intact THEN "TIER2"
    ELSE "FALLBACK"

PlanTarget == IF AllReach THEN V ELSE t2

Reconcile ==
    /\ phase = "RECONCILING"
    /\ PlanKind # "FALLBACK"
    /\ LET tgt == PlanTarget IN
       /\ data' = [r \in Ranks |-> [c \in Chunks |->
                     \* Mutant no_undo: a TORN chunk is not undone; recovery
                     \* trusts its unchanged version header and keeps the
                     \* torn bytes.
                     IF Mutant = "no_undo" /\ data[r][c] = TORN
                     THEN GARBAGE ELSE tgt]]
       /\ par' = ParityAt(tgt)
       \* The snapshot is retaken only if some of its blocks were lost: an intact
       \* one (at t2 <= tgt, at most K steps back) still covers a node loss.
       /\ t2' = IF t2lost = {} THEN t2 ELSE tgt
       /\ committed' = tgt
       /\ target' = tgt
       /\ loss' = committed - tgt
    /\ undo' = [r \in Ranks |-> [c \in Chunks |-> NONE]]
    /\ grad' = [r \in Ranks |-> NONE]
    /\ gpar' = NoGradParity
    /\ t2lost' = {}
    /\ prepared' = {}
    /\ kind' = PlanKind
    /\ phase' = "REBUILDING"
    /\ UNCHANGED <<trainer, tgen, pc, step, tail, shadow, stale, gen, faults, mlost,
                   nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

GoFallback ==
    /\ phase = "RECONCILING"
    /\ PlanKind = "FALLBACK"
    /\ phase' = "FALLBACK"
    /\ UNCHANGED <<trainer, tgen, pc, step, tail, data, undo, grad, shadow, stale,
                   par, gpar, gen, committed, prepared, faults, t2, t2lost,
                   target, kind, loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

\* Tier 3: the latest durable disk checkpoint.  A writer's missing shard
\* (only the mutant early_durable leaves one) loads bytes of no step.
RestoreCheckpoint ==
    /\ phase = "FALLBACK"
    /\ data' = [r \in Ranks |-> [c \in Chunks |->
                  IF r \in ckmiss THEN GARBAGE ELSE ckpt]]
    /\ undo' = [r \in Ranks |-> [c \in Chunks |-> NONE]]
    /\ par' = ParityAt(ckpt)
    /\ grad' = [r \in Ranks |-> NONE]
    /\ gpar' = NoGradParity
    /\ t2' = ckpt
    /\ t2lost' = {}
    /\ committed' = ckpt
    /\ prepared' = {}
    /\ target' = ckpt
    /\ kind' = "CKPT"
    /\ loss' = committed - ckpt
    /\ phase' = "REBUILDING"
    /\ UNCHANGED <<trainer, tgen, pc, step, tail, shadow, stale, gen, faults, mlost,
                   nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

\* The survivors re-initialise the process group at the new generation.
Rebuild ==
    /\ phase = "REBUILDING"
    /\ \A r \in Ranks : trainer[r] = "ALIVE"
    /\ tgen' = [r \in Ranks |-> gen]
    /\ phase' = "RESUMING"
    /\ UNCHANGED <<trainer, pc, step, tail, data, undo, grad, shadow, stale, par,
                   gpar, gen, committed, prepared, faults, t2, t2lost, target,
                   kind, loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

\* Every rank restores the process state of target after its loop tail: the
\* closed state of target if its agent kept one (tail[r] >= target; a tier-2
\* or checkpoint restore brings its own), else the closed state of target - 1
\* with the tail replayed (the scheduler stepped, the scaler's update redone).
Resume ==
    /\ phase = "RESUMING"
    /\ \A r \in Ranks : trainer[r] = "ALIVE"
    \* Mutant stale_shadow: a promoted rank keeps the step its shadow was
    \* warmed at (0).
    /\ step' = [r \in Ranks |-> IF Mutant = "stale_shadow" /\ r \in promoted
                                THEN 0 ELSE target]
    \* Mutant stale_tail: a rank that finished target but did not close it
    \* restores the open state it sent at Finish (before its tail), the tail
    \* not replayed.
    /\ tail' = [r \in Ranks |-> IF Mutant = "stale_shadow" /\ r \in promoted
                                THEN 0
                                ELSE IF /\ Mutant = "stale_tail"
                                        /\ tail[r] < target /\ target <= step[r]
                                THEN target - 1 ELSE target]
    /\ pc' = [r \in Ranks |-> "IDLE"]
    /\ target' = NONE
    /\ promoted' = {}
    /\ mlost' = {}
    /\ nlost' = {}
    /\ phase' = "RUNNING"
    /\ UNCHANGED <<trainer, tgen, data, undo, grad, shadow, stale, par, gpar,
                   gen, committed, prepared, faults, t2, t2lost, kind, loss,
                   stale_writes>>
    /\ UNCHANGED ckvars

-----------------------------------------------------------------------------
Next ==
    \/ \E r \in Ranks : Compute(r) \/ Reduce(r) \/ Prepare(r) \/ Finish(r) \/ Close(r)
    \/ Decide
    \/ \E r \in Ranks, c \in Chunks :
          BeginChunk(r, c) \/ EndChunk(r, c) \/ ParityChunk(r, c)
    \/ Tier2Snapshot
    \/ BeginCheckpoint \/ CheckpointDurable \/ \E r \in Ranks : WriteShard(r)
    \/ \E r \in Ranks : ShadowWarm(r) \/ ShadowReclaim(r)
    \/ \E r \in Ranks : Crash(r) \/ Hang(r) \/ LoseMemory(r)
    \/ \E n \in Nodes : LoseNode(n)
    \/ \E r \in Ranks, c \in Chunks : StaleWrite(r, c)
    \/ Detect
    \/ Fence
    \/ \E r \in Ranks : Promote(r)
    \/ EndPromote
    \/ Reconcile
    \/ GoFallback
    \/ RestoreCheckpoint
    \/ Rebuild
    \/ Resume

\* Weak fairness on every action except the faults.
Fairness ==
    /\ \A r \in Ranks : /\ WF_vars(Compute(r)) /\ WF_vars(Reduce(r))
                        /\ WF_vars(Prepare(r)) /\ WF_vars(Finish(r))
                        /\ WF_vars(Close(r))
                        /\ WF_vars(ShadowWarm(r)) /\ WF_vars(ShadowReclaim(r))
                        /\ WF_vars(Promote(r)) /\ WF_vars(WriteShard(r))
    /\ \A r \in Ranks, c \in Chunks : /\ WF_vars(BeginChunk(r, c))
                                      /\ WF_vars(EndChunk(r, c))
                                      /\ WF_vars(ParityChunk(r, c))
                                      /\ WF_vars(StaleWrite(r, c))
    /\ WF_vars(Decide) /\ WF_vars(Tier2Snapshot)
    /\ WF_vars(BeginCheckpoint) /\ WF_vars(CheckpointDurable)
    /\ WF_vars(Detect) /\ WF_vars(Fence) /\ WF_vars(EndPromote)
    /\ WF_vars(Reconcile) /\ WF_vars(GoFallback) /\ WF_vars(RestoreCheckpoint)
    /\ WF_vars(Rebuild) /\ WF_vars(Resume)

Spec == Init /\ [][Next]_vars /\ Fairness

\* Weak fairness on the recovery actions only.  Every trainer action needs
\* phase = RUNNING, so the other fairness conditions of Spec cannot matter to
\* Progress; Spec => RecoverySpec, so RecoverySpec => Progress (what TLC checks,
\* with fewer fairness conditions to track) implies Spec => Progress.
RecoveryFairness ==
    /\ \A r \in Ranks : /\ WF_vars(ShadowWarm(r) /\ trainer[r] = "DEAD")
                        /\ WF_vars(Promote(r))
    /\ WF_vars(Detect) /\ WF_vars(Fence) /\ WF_vars(EndPromote)
    /\ WF_vars(Reconcile) /\ WF_vars(GoFallback) /\ WF_vars(RestoreCheckpoint)
    /\ WF_vars(Rebuild) /\ WF_vars(Resume)

RecoverySpec == Init /\ [][Next]_vars /\ RecoveryFairness

-----------------------------------------------------------------------------
(* Bounded recovery: what the implementation guarantees when a shadow      *)
(* never comes (its build fails, it hangs) or anything else a recovery     *)
(* waits for does not.                                                     *)

\* The recovery deadline (--recovery-timeout) passes: the job stops, exit 1,
\* one line naming what the recovery still waits for.  The core's event
\* GiveUp (phase FAILED, which accepts no further event), scheduled by
\* leto.core.schedule when the backend reports the deadline overdue; in
\* BoundedNext, not Next (the checker's "deadline" configuration adds it, and
\* its check "Bounded" asks it enabled in every recovery state).  It may
\* pass at any moment of a recovery.  (Mutant no_timeout:
\* the deadline does not cover promotion, which waits for shadows: the bug of
\* a coordinator whose timer ran only while it waited for acknowledgements.)
GiveUp ==
    /\ phase \notin {"RUNNING", "FAILED"}
    /\ ~(Mutant = "no_timeout" /\ phase = "PROMOTING")
    /\ phase' = "FAILED"
    /\ UNCHANGED <<trainer, tgen, pc, step, tail, data, undo, grad, shadow, stale,
                   par, gpar, gen, committed, prepared, faults, t2, t2lost,
                   target, kind, loss, mlost, nlost, promoted, stale_writes>>
    /\ UNCHANGED ckvars

BoundedNext == Next \/ GiveUp

\* The recovery actions are fair as in RecoveryFairness, and so is the
\* deadline; a shadow is not: it may never become warm.
BoundedFairness ==
    /\ \A r \in Ranks : WF_vars(Promote(r))
    /\ WF_vars(Detect) /\ WF_vars(Fence) /\ WF_vars(EndPromote)
    /\ WF_vars(Reconcile) /\ WF_vars(GoFallback) /\ WF_vars(RestoreCheckpoint)
    /\ WF_vars(Rebuild) /\ WF_vars(Resume)
    /\ WF_vars(GiveUp)

BoundedSpec == Init /\ [][BoundedNext]_vars /\ BoundedFairness

-----------------------------------------------------------------------------
(* Invariants (plain words in spec/README.md).                             *)

StepVals == Steps
TypeOK ==
    /\ trainer \in [Ranks -> {"ALIVE", "DEAD", "HUNG"}]
    /\ tgen \in [Ranks -> Nat]
    /\ pc \in [Ranks -> {"IDLE", "COMPUTED", "REDUCED", "PREPARED", "APPLYING",
                         "TAIL"}]
    /\ step \in [Ranks -> Steps]
    /\ tail \in [Ranks -> Steps]
    /\ data \in [Ranks -> [Chunks -> Steps \cup {TORN, LOST, GARBAGE}]]
    /\ undo \in [Ranks -> [Chunks -> Steps \cup {NONE}]]
    /\ grad \in [Ranks -> (1..MaxStep) \cup {NONE, LOST}]
    /\ shadow \in [Ranks -> {NONE, "COLD", "WARM"}]
    /\ stale \in [Ranks -> BOOLEAN]
    /\ DOMAIN par = Nodes
    /\ \A n \in Nodes :
          /\ DOMAIN par[n] = Chunks
          /\ \A c \in Chunks : par[n][c] = LOST
                                \/ par[n][c] \in [RanksOf(n) -> Steps]
          /\ gpar[n] = LOST
             \/ gpar[n] \in [RanksOf(n) -> (1..MaxStep) \cup {NONE}]
    /\ DOMAIN gpar = Nodes
    /\ gen \in Nat
    /\ phase \in Phases
    /\ committed \in Steps
    /\ prepared \subseteq Ranks
    /\ faults \in 0..MaxFaults
    /\ t2 \in Steps
    /\ t2lost \subseteq Nodes
    /\ target \in Steps \cup {NONE}
    /\ kind \in Kinds \cup {NONE}
    /\ loss \in Steps
    /\ mlost \subseteq Ranks
    /\ nlost \subseteq Nodes
    /\ promoted \subseteq Ranks
    /\ stale_writes \in Nat
    /\ ckpt \in Steps
    /\ cpend \in Steps \cup {NONE}
    /\ ckdone \subseteq Ranks
    /\ ckmiss \subseteq Ranks

\* A chunk a fault destroyed: its rank's trainer is then dead.
LostByFault(r, c) == data[r][c] = LOST /\ trainer[r] = "DEAD"

Consistency ==
    /\ phase \in {"REBUILDING", "RESUMING"} =>
          \A r \in Ranks, c \in Chunks : data[r][c] = target \/ LostByFault(r, c)
    \* A failed rank (not yet detected) is recovery's business.
    /\ phase = "RUNNING" =>
          \A r \in Ranks : trainer[r] = "ALIVE" /\ tgen[r] = gen =>
             /\ step[r] \in {committed, committed - 1}
             /\ \A c \in Chunks :
                   \/ data[r][c] = step[r]
                   \/ pc[r] = "APPLYING" /\ data[r][c] \in {step[r] + 1, TORN}

Equivalence ==
    \A r \in Ranks, c \in Chunks :
        /\ data[r][c] # GARBAGE
        /\ data[r][c] = TORN => undo[r][c] # NONE

Tier1Covered ==
    \A n \in Nodes : n \notin nlost /\ Cardinality(mlost \cap RanksOf(n)) <= 1
\* At most one node lost more than its tier-1 parity rebuilds (and, in a
\* one-node job, that node was not lost).
Tier2Covered ==
    /\ Cardinality({n \in Nodes : n \in nlost
                                  \/ Cardinality(mlost \cap RanksOf(n)) >= 2}) <= T2Parity
    /\ Cardinality(nlost) <= T2Survives

\* Checked on the states after Reconcile / RestoreCheckpoint, up to Resume
\* (mlost and nlost only grow until Resume clears them).
Durability ==
    phase \in {"REBUILDING", "RESUMING"} =>
        /\ kind \in {"INPLACE", "FORWARD", "BACK", "TIER1"} => loss = 0
        /\ kind = "TIER2" => loss <= K /\ ~Tier1Covered
        \* the fallback restores the latest durable checkpoint: it gives up
        \* the committed steps after it, and only beyond both tiers
        /\ kind = "CKPT" => ~Tier2Covered /\ target = ckpt

ParityOK ==
    /\ \A n \in Nodes, c \in Chunks :
          par[n][c] # LOST =>
             \A r \in RanksOf(n) :
                data[r][c] # LOST => par[n][c][r] \in Local(r, c)
    /\ \A n \in Nodes :
          gpar[n] # LOST =>
             \A r \in RanksOf(n) :
                \/ grad[r] = LOST
                \* reduced gradients of the next step, not yet voted for
                \/ grad[r] = committed + 1 /\ r \notin prepared
                \/ gpar[n][r] = grad[r]

\* No write of an old generation is accepted, and no trainer is admitted in
\* a generation the coordinator has not opened.
SingleWriter ==
    /\ stale_writes = 0
    /\ \A r \in Ranks : tgen[r] <= gen

Integrity ==
    phase \in {"REBUILDING", "RESUMING"} =>
        \A r \in Ranks, c \in Chunks :
            /\ data[r][c] \notin {TORN, GARBAGE}
            /\ data[r][c] = LOST => trainer[r] = "DEAD"

\* Every running rank's process state includes the loop tail of every step it
\* finished, but the one whose tail it is in: replicas never resume with a
\* scheduler (scaler, ...) a step behind their peers'.
TailOK ==
    phase = "RUNNING" =>
        \A r \in Ranks : trainer[r] = "ALIVE" /\ tgen[r] = gen =>
            tail[r] = IF pc[r] = "TAIL" THEN step[r] - 1 ELSE step[r]

Progress == (phase # "RUNNING") ~> (phase = "RUNNING")

\* Every failure leads to training with every trainer alive, or to the job
\* stopped (checked on BoundedSpec: MCLetoLiveness.cfg).
Liveness ==
    (\E r \in Ranks : trainer[r] # "ALIVE")
        ~> (phase = "FAILED" \/ (phase = "RUNNING" /\ \A r \in Ranks : trainer[r] = "ALIVE"))

=============================================================================
