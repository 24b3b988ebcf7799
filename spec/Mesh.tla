-------------------------------- MODULE Mesh --------------------------------
(***************************************************************************)
(* Protection by the mesh (PROTOCOL.md, "Protection on a device mesh";     *)
(* leto/core/mesh.py place_mesh).                                          *)
(*                                                                         *)
(* A device mesh of D dimensions, each of size 1..MaxSide; ranks numbered  *)
(* row-major; nodes of k consecutive ranks (k divides the world).  Two     *)
(* ranks hold identical state iff their coordinates differ only along the  *)
(* replicate dimensions Rep.  Init picks the mesh, Rep, k, the tier-2      *)
(* parity p and 1..MaxFail failures (a rank's memory, a whole node); the   *)
(* actions are the recovery: copy a lost rank from a live replica, rebuild *)
(* the one missing member of a node's tier-1 parity group, and, when       *)
(* neither can go on, roll back to the tier-2 snapshots (tier 2: the lost  *)
(* nodes are at most p) or fall back to the disk checkpoint (tier 3).      *)
(*                                                                         *)
(* A single parity is modelled by what it can rebuild: the XOR of its      *)
(* members' blocks, so two members holding the same state cancel out      *)
(* (A xor A = 0) and the parity knows nothing of that state.               *)
(*                                                                         *)
(* Mutants: "parity_over_replicas" puts every rank of a node in its parity *)
(* group, replicas counted as distinct members: two replicas of a node     *)
(* lost together are no longer rebuilt (violates Promise with MaxFail = 2, *)
(* and ParityOverStates); "replica_on_own_node" has the rule count a       *)
(* replica on the rank's own node as protection against that node's loss  *)
(* (violates Promise).                                                     *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets

CONSTANTS D, MaxSide, MaxFail, Mutant

ASSUME D \in Nat \ {0} /\ MaxSide \in Nat \ {0} /\ MaxFail \in {1, 2}
ASSUME Mutant \in {"none", "parity_over_replicas", "replica_on_own_node"}

Dims == 1..D

VARIABLES
    shape,   \* shape[i]: the size of dimension i
    rep,     \* the replicate dimensions
    k,       \* ranks per node
    p,       \* tier-2 parity: how many whole nodes the snapshots survive
    fail,    \* the failures: a set of [kind |-> "rank" or "node", id |-> which]
    lost,    \* the ranks whose state is missing at the current step
    tier,    \* 1 while restoring at the current step; 2 rolled back; 3 disk
    st       \* st[r]: what rank r's state is (fixed at Init: computed once, not per state)

vars == <<shape, rep, k, p, fail, lost, tier, st>>

RECURSIVE Prod(_, _)
Prod(f, S) == IF S = {} THEN 1
              ELSE LET x == CHOOSE x \in S : TRUE IN f[x] * Prod(f, S \ {x})

Ranks == DOMAIN st
W == Cardinality(Ranks)
Nodes == 0..(W \div k - 1)
Node(r) == r \div k
RanksOf(n) == {r \in Ranks : Node(r) = n}
Coord(r, i) == (r \div Prod(shape, {j \in Dims : j > i})) % shape[i]
StateOf(r) == [i \in Dims \ rep |-> Coord(r, i)]
State(r) == st[r]
Replica(q, r) == q /= r /\ State(q) = State(r)

\* ---- the placement rule (place_mesh) --------------------------------------
\* A node's parity group: the lowest rank of every state on the node, when the node
\* holds two states or more, or one state no other rank holds (its mirror).
Reps(n) == {r \in RanksOf(n) : \A q \in RanksOf(n) : Replica(q, r) => r < q}
ParityMembers(n) ==
    IF Mutant = "parity_over_replicas"
    THEN RanksOf(n)
    ELSE IF Cardinality(Reps(n)) >= 2 \/ \A r \in Reps(n) : \A q \in Ranks : ~Replica(q, r)
         THEN Reps(n) ELSE {}

\* What the rule promises: a lost rank comes back at the current step when a replica
\* outside the failure or its node's parity group covers it.
CoveredRank(r) == (\E q \in Ranks : Replica(q, r)) \/ r \in ParityMembers(Node(r))
CoveredNode(n) ==
    \A r \in RanksOf(n) :
        \E q \in Ranks : Replica(q, r) /\ (Node(q) /= n \/ Mutant = "replica_on_own_node")
DeadNodes == {f.id : f \in {g \in fail : g.kind = "node"}}
Lost0 == {f.id : f \in {g \in fail : g.kind = "rank"}} \cup UNION {RanksOf(n) : n \in DeadNodes}

\* One failure: covered exactly as above.  Several: a sufficient condition, checked in
\* one direction only: every lost rank has a replica outside the failures, or its node
\* survives and its parity group misses only its state (the others held by live ranks).
Live(s) == \E q \in Ranks \ Lost0 : State(q) = s
CoveredInGroup(r) ==
    /\ Node(r) \notin DeadNodes
    /\ \E m \in ParityMembers(Node(r)) : State(m) = State(r)
    /\ \A m \in ParityMembers(Node(r)) : State(m) = State(r) \/ Live(State(m))
CoveredAll == \A r \in Lost0 : Live(State(r)) \/ CoveredInGroup(r)
Covered ==
    LET f == CHOOSE g \in fail : TRUE
    IN IF f.kind = "rank" THEN CoveredRank(f.id) ELSE CoveredNode(f.id)

\* ---- the recovery ----------------------------------------------------------
Divisors(n) == {d \in 1..n : n % d = 0}
Shapes == [Dims -> 1..MaxSide]
Failures == [kind : {"rank"}, id : Ranks] \cup [kind : {"node"}, id : Nodes]
\* a rank's memory loss on a node lost too is subsumed by the node loss
FailSets == {{f} : f \in Failures}
            \cup IF MaxFail = 2 THEN {{f, g} : f, g \in Failures} ELSE {}
Subsumed(F) == \E f, g \in F : f.kind = "rank" /\ g.kind = "node" /\ Node(f.id) = g.id

Init ==
    /\ shape \in Shapes
    /\ rep \in SUBSET Dims
    /\ st = [r \in 0..(Prod(shape, Dims) - 1) |-> StateOf(r)]
    /\ k \in Divisors(W)
    /\ p \in 0..(W \div k - 1)
    /\ fail \in {F \in FailSets : ~Subsumed(F)}
    /\ lost = Lost0
    /\ tier = 1

Copy(r) ==
    /\ r \in lost
    /\ \E q \in Ranks \ lost : Replica(q, r)
    /\ lost' = lost \ {r}
    /\ UNCHANGED <<shape, rep, k, p, fail, tier, st>>

\* XOR parity: the missing member's state must be the only unknown one, and held by an
\* odd number of the members (an even number cancels out)
Rebuild(n) ==
    LET M == ParityMembers(n)
        gone == M \cap lost
    IN /\ n \notin DeadNodes
       /\ Cardinality(gone) = 1
       /\ LET r == CHOOSE x \in gone : TRUE
          IN Cardinality({q \in M : State(q) = State(r)}) % 2 = 1
       /\ lost' = lost \ gone
       /\ UNCHANGED <<shape, rep, k, p, fail, tier, st>>

Stuck == ~\E r \in lost : ENABLED Copy(r) \/ \E n \in Nodes \ DeadNodes : ENABLED Rebuild(n)

Rollback ==
    /\ lost /= {} /\ tier = 1 /\ Stuck
    /\ tier' = IF Cardinality(DeadNodes) <= p THEN 2 ELSE 3
    /\ lost' = {}
    /\ UNCHANGED <<shape, rep, k, p, fail, st>>

Done == lost = {} /\ UNCHANGED vars

Next == (\E r \in lost : Copy(r)) \/ (\E n \in Nodes : Rebuild(n)) \/ Rollback \/ Done

Spec == Init /\ [][Next]_vars

\* ---- properties --------------------------------------------------------------
TypeOK ==
    /\ shape \in Shapes /\ rep \subseteq Dims /\ k \in Divisors(W)
    /\ DOMAIN st = 0..(W - 1)
    /\ fail \subseteq Failures /\ lost \subseteq Ranks /\ tier \in 1..3

\* Every single rank failure is covered: the rule leaves no rank without protection.
Complete == \A r \in Ranks : CoveredRank(r)

\* A parity group holds one member per state: XOR over two replicas would cancel them.
ParityOverStates ==
    \A n \in Nodes : \A a, b \in ParityMembers(n) : a /= b => State(a) /= State(b)

\* Recovery over: one failure is recovered at the current step exactly when the rule
\* says it is covered, several at least when CoveredAll says so; otherwise by the
\* tier-2 rollback, or the disk only where more nodes are lost than p.
Promise ==
    lost = {} =>
        /\ Cardinality(fail) = 1 => (tier = 1) = Covered
        /\ CoveredAll => tier = 1
        /\ tier = 3 => Cardinality(DeadNodes) > p

\* Reachability (MCMesh_reach.cfg: TLC must report it violated, so that Promise does
\* not hold vacuously): a node loss recovered at the current step, from replicas on
\* other nodes.
NoNodeLossAtTier1 == ~(DeadNodes /= {} /\ lost = {} /\ tier = 1)
=============================================================================
