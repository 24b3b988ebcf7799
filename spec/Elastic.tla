------------------------------ MODULE Elastic ------------------------------
(***************************************************************************)
(* The world of an elastic data-parallel job (leto launch --nnodes MIN:MAX) *)
(* across node losses: replaced from the spare pool, shrunk when no spare  *)
(* comes within the spare timeout, grown back when a spare arrives.        *)
(*                                                                         *)
(* It composes with Leto.tla at step boundaries: a recovery of Leto.tla    *)
(* ends with every surviving rank at the committed step, and that is where *)
(* this module's world changes happen; one Train action is one committed   *)
(* step of Leto.tla.  The retained state abstracted here is the replicated *)
(* (data-parallel) state: every member holds a replica, and a replica's    *)
(* value is the world sizes it was trained with, step by step (hist[n]).  *)
(* The data order of a step depends on the world size it ran with, so the *)
(* run to compare with is the failure-free run of the same world-size      *)
(* schedule (sched): Equivalence says every member's replica is that run's.*)
(*                                                                         *)
(* world is a sequence: rank i-1 is node world[i] (ranks dense, 0-based).  *)
(* A shrink drops the lost members and keeps the order of the others       *)
(* (they are renumbered densely); a grow appends the spare as the last     *)
(* rank.  Both start a new generation (gen).                               *)
(*                                                                         *)
(* In place: a world change keeps every committed step.  The survivors go  *)
(* on from their retained replicas (no process restart, no reload from a   *)
(* disk checkpoint), so no step is trained twice: InPlace says the steps   *)
(* trained (trained, every Train counted) are the schedule's steps.        *)
(*                                                                         *)
(* Mutant (one flag): "below_min" shrinks whatever the world left (caught  *)
(* by InRange); "stale_grow" gives a grown spare the state of the job's    *)
(* start instead of a member's replica (caught by Equivalence);          *)
(* "from_disk" carries a shrink out as a restart of the job from its      *)
(* latest disk checkpoint, one step behind (caught by InPlace).            *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets

CONSTANTS
    Nodes,      \* every node that may ever take part (members and spares)
    Start,      \* the world the job starts with: a sequence of distinct nodes
    Min, Max,   \* --nnodes MIN:MAX
    MaxStep,    \* steps trained
    MaxFaults,  \* nodes lost, at most
    MaxJoins,   \* spares joining the pool, at most
    Mutant      \* "none", "below_min", "stale_grow" or "from_disk"

ASSUME /\ 1 <= Min /\ Min <= Len(Start) /\ Len(Start) <= Max
       /\ Mutant \in {"none", "below_min", "stale_grow", "from_disk"}

Range(f) == {f[i] : i \in DOMAIN f}

VARIABLES
    world,   \* the members, in rank order
    pool,    \* spares: up, holding no rank
    up,      \* nodes whose agent is alive
    lost,    \* members lost, awaiting a replacement (or a shrink)
    held,    \* nodes holding a replica of the retained state
    hist,    \* hist[n]: the world sizes n's replica was trained with, step by step
    sched,   \* the world-size schedule of the job: sched[s] = world size of step s
    phase,   \* "RUNNING", "AWAITING" (a member lost), "STOPPED", "DONE"
    gen,     \* the generation: bumped by every world change
    faults, joins,
    trained  \* steps trained, a step trained again counted again

vars == <<world, pool, up, lost, held, hist, sched, phase, gen, faults, joins, trained>>

Init ==
    /\ world = Start
    /\ pool = {}
    /\ up = Range(Start)
    /\ lost = {}
    /\ held = Range(Start)
    /\ hist = [n \in Nodes |-> <<>>]
    /\ sched = <<>>
    /\ phase = "RUNNING"
    /\ gen = 0
    /\ faults = 0
    /\ joins = 0
    /\ trained = 0

\* One committed step (Leto.tla's transaction) with the world as it is.
Train ==
    /\ phase = "RUNNING"
    /\ Len(sched) < MaxStep
    /\ sched' = Append(sched, Len(world))
    /\ hist' = [n \in Nodes |-> IF n \in Range(world)
                                THEN Append(hist[n], Len(world)) ELSE hist[n]]
    /\ trained' = trained + 1
    /\ UNCHANGED <<world, pool, up, lost, held, phase, gen, faults, joins>>

\* A member's node is lost (its agent, keepers and memory): its replica goes.
LoseNode(n) ==
    /\ phase \in {"RUNNING", "AWAITING"}
    /\ n \in Range(world) \ lost
    /\ faults < MaxFaults
    /\ up' = up \ {n}
    /\ lost' = lost \cup {n}
    /\ held' = held \ {n}
    /\ phase' = "AWAITING"
    /\ faults' = faults + 1
    /\ UNCHANGED <<world, pool, hist, sched, gen, joins, trained>>

\* A node that is down joins the pool: a new one, or a lost one repaired once
\* the world no longer names it (a lost member keeps its rank until it is
\* replaced or shrunk away).
SpareJoins(n) ==
    /\ phase \in {"RUNNING", "AWAITING"}
    /\ n \in Nodes \ (up \cup Range(world))
    /\ joins < MaxJoins
    /\ up' = up \cup {n}
    /\ pool' = pool \cup {n}
    /\ joins' = joins + 1
    /\ UNCHANGED <<world, lost, held, hist, sched, phase, gen, faults, trained>>

Survivor == CHOOSE m \in Range(world) \ lost : TRUE

\* A spare takes a lost member's rank; its replica is decoded from (here: a
\* copy of) a survivor's.
Replace(n, s) ==
    /\ phase = "AWAITING"
    /\ n \in lost
    /\ s \in pool
    /\ Range(world) \ lost # {}
    /\ world' = [i \in DOMAIN world |-> IF world[i] = n THEN s ELSE world[i]]
    /\ pool' = pool \ {s}
    /\ lost' = lost \ {n}
    /\ held' = held \cup {s}
    /\ hist' = [hist EXCEPT ![s] = hist[Survivor]]
    /\ phase' = IF lost' = {} THEN "RUNNING" ELSE "AWAITING"
    /\ gen' = gen + 1
    /\ UNCHANGED <<up, sched, faults, joins, trained>>

Kept(n) == n \notin lost

\* The spare timeout passed with the pool empty and at least Min members left:
\* the job goes on without the lost members, the others renumbered densely, in
\* place: their replicas and the schedule are kept.
Behind(q) == SubSeq(q, 1, IF Len(q) > 0 THEN Len(q) - 1 ELSE 0)
Shrink ==
    /\ phase = "AWAITING"
    /\ pool = {}
    /\ Mutant = "below_min" \/ Len(world) - Cardinality(lost) >= Min
    /\ world' = SelectSeq(world, Kept)
    /\ lost' = {}
    /\ phase' = "RUNNING"
    /\ gen' = gen + 1
    /\ IF Mutant = "from_disk"
       THEN /\ sched' = Behind(sched)
            /\ hist' = [n \in Nodes |-> IF n \in Range(world) THEN Behind(hist[n]) ELSE hist[n]]
       ELSE UNCHANGED <<hist, sched>>
    /\ UNCHANGED <<pool, up, held, faults, joins, trained>>

\* The spare timeout passed with the pool empty and fewer than Min left, or no
\* member is left to copy a replica from: the job stops in one line (or
\* restarts whole from its checkpoint, --max-restarts; not modelled here).
Stop ==
    /\ phase = "AWAITING"
    /\ pool = {} \/ Range(world) \ lost = {}
    /\ Len(world) - Cardinality(lost) < Min
    /\ Mutant # "below_min"
    /\ phase' = "STOPPED"
    /\ UNCHANGED <<world, pool, up, lost, held, hist, sched, gen, faults, joins, trained>>

\* A spare in the pool while the world is below Max: at the step boundary it
\* joins as the last rank, its replica copied from a member's (broadcast).
Grow(s) ==
    /\ phase = "RUNNING"
    /\ s \in pool
    /\ Len(world) < Max
    /\ world' = Append(world, s)
    /\ pool' = pool \ {s}
    /\ held' = held \cup {s}
    /\ hist' = [hist EXCEPT ![s] = IF Mutant = "stale_grow" THEN <<>> ELSE hist[world[1]]]
    /\ gen' = gen + 1
    /\ UNCHANGED <<up, lost, sched, phase, faults, joins, trained>>

Finish ==
    /\ phase = "RUNNING"
    /\ Len(sched) = MaxStep
    /\ phase' = "DONE"
    /\ UNCHANGED <<world, pool, up, lost, held, hist, sched, gen, faults, joins, trained>>

\* The job has ended: nothing more happens (not a deadlock).
Ended == phase \in {"DONE", "STOPPED"} /\ UNCHANGED vars

Resolve == (\E n \in Nodes, s \in Nodes : Replace(n, s)) \/ Shrink \/ Stop

Next ==
    \/ Train
    \/ \E n \in Nodes : LoseNode(n) \/ SpareJoins(n) \/ Grow(n)
    \/ Resolve
    \/ Finish
    \/ Ended

Spec == Init /\ [][Next]_vars /\ WF_vars(Resolve) /\ WF_vars(Train) /\ WF_vars(Finish)

-----------------------------------------------------------------------------

TypeOK ==
    /\ world \in Seq(Nodes)
    /\ pool \subseteq up
    /\ up \subseteq Nodes
    /\ lost \subseteq Range(world)
    /\ held \subseteq Nodes
    /\ phase \in {"RUNNING", "AWAITING", "STOPPED", "DONE"}
    /\ gen \in Nat /\ faults \in Nat /\ joins \in Nat

\* Ranks are dense and each node holds one role: a member (one rank) or a spare.
Roles ==
    /\ \A i, j \in DOMAIN world : i # j => world[i] # world[j]
    /\ Range(world) \cap pool = {}
    /\ Range(world) \ lost \subseteq up \cap held
    /\ lost \cap up = {}

\* The job trains only with a world of Min..Max nodes, and every step of its
\* schedule ran on such a world.
InRange ==
    /\ phase = "RUNNING" => Min <= Len(world) /\ Len(world) <= Max
    /\ \A s \in DOMAIN sched : Min <= sched[s] /\ sched[s] <= Max

\* Every live member's replica is the failure-free run of the same world-size
\* schedule.
Equivalence == \A n \in Range(world) \ lost : hist[n] = sched

\* In place: no step was trained twice (a world change loses no committed step).
InPlace == trained = Len(sched)

\* A node lost with no spare is either replaced, shrunk away, or the job stops.
Progress == phase = "AWAITING" ~> phase \in {"RUNNING", "STOPPED"}

\* The job ends (trains every step, or stops in one line).
Ends == <>(phase \in {"DONE", "STOPPED"})

\* Witnesses, checked as invariants that TLC must report violated (so the main
\* check cannot pass vacuously): a world shrunk and grown back, the steps
\* trained on each side; a job stopped below Min.
NeverRegrown ==
    ~\E i, j, k \in DOMAIN sched : i < j /\ j < k /\ sched[i] > sched[j] /\ sched[j] < sched[k]
NeverStopped == phase # "STOPPED"
=============================================================================
