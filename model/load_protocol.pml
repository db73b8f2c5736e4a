/*
 * model/load_protocol.pml: kvfuse's load and save protocol, checked by spin.
 * docs/model.md says what it covers, what it leaves out and how to run it.
 *
 * One scheduler thread drives a Coordinator over an OffloadIndex, a SettlementPump and a
 * TpQuorum; NR ranks (processes, as under ShmEngine) take the loads and saves it sends and
 * report on them; two requests are admitted, torn down, finished and admitted again. Every
 * call on the scheduler thread is one indivisible step (a d_step): spin tries every order
 * of those calls, of the ranks' progress between them, and of rank deaths and returns.
 * Where the code decides something the model does the same, in the same order; each part
 * names the rule (docs/rules.md, R1..R20) it encodes.
 *
 * Checked, for this size (assertions; spin -a, pan with -DSAFETY):
 *   P1 every load is resolved exactly once (settled by its ranks, failed, abandoned or
 *      reclaimed); a parked request is unparked once, by its own load; the quorum settles
 *      only keys the index holds in flight;
 *   P2 no key is stranded: in every state where nothing can move any more (the clients
 *      stopped: no admit, teardown, finish, death or return; the protocol did all it
 *      will), no request is parked, every load and save is resolved, every table is empty
 *      and every admission that ended was freed (the `timeout` option below);
 *   P3 every admission is freed exactly once, and never while it is its request's running one;
 *   P4 no slot or block is freed, and no request resumes into its blocks, while a rank that
 *      is up may still write them (it took the load and has not emitted its record) or read
 *      them (a save's gather that has not released);
 *   P5 a record of an earlier admission never settles a later one: a resolution unparks
 *      only the admission whose load it is, and an orphan's only frees its own.
 *
 * Switches (spin -DNAME ...):
 *   NR, NG, NA, MAXCRASH, MAXREST   ranks, keys, admissions, deaths, returns (the size)
 *   STRANDED_BUG         the control: mark_rank_dead does not settle a key no live rank
 *                        owes (the stranded-load bug); spin must find a stranded request
 *   LOADS_ONLY           no saves (the control runs with it, so what it strands is a load)
 *   ALIVE_WITHOUT_SWEEP  mark_rank_alive as it was before the model found its hole: it does
 *                        not sweep while every rank is dead; spin then finds a key issued
 *                        while every rank was dead that nothing settles
 *   RETURN_AFTER_SWEEP   the timing restriction that hid that hole (see RETURN_OK): a rank
 *                        comes back only after the step that swept every key issued so far
 *   TICKET_WINDOW        the engine may hold a load ticket across steps, deaths and returns
 *                        before it dispatches or drops it, as the index API allows and the
 *                        Coordinator never does
 *   EAGER_RECLAIM        drops the timing assumption on reclaim: spin then finds a slot
 *                        freed while a live rank still writes it
 *
 * Extension point: a partial restore (a rank reports how many chunks it restored; the
 * quorum keeps the minimum; the request resumes there) is a per-key minimum next to qfail
 * (q_add_load), a number in the rank's record (choose_ranks) and the claimed tokens on
 * the Unpark (unpark); nothing else changes shape.
 */

#ifndef NR
#define NR 2            /* ranks (2 or 3) */
#endif
#ifndef NG
#define NG 3            /* keys the index may issue, loads and saves together (at most 6) */
#endif
#ifndef NA
#define NA 2            /* admissions, both requests together (at most 4) */
#endif
#ifndef MAXCRASH
#define MAXCRASH 2      /* rank process deaths */
#endif
#ifndef MAXREST
#define MAXREST 1       /* rank returns (a new incarnation attaches) */
#endif
#define NQ 2            /* requests */

/* COVER(n): with -DCOVER_ID=n, reaching the place is an assertion that fails, so spin
   shows a path there (model/check.sh --coverage: no place the properties speak of is
   unreachable). Without it, nothing. */
#ifdef COVER_ID
#define COVER(n) assert(COVER_ID != n)
#else
#define COVER(n) skip
#endif

#define ALL ((1 << NR) - 1)
#define BIT(r) (1 << (r))

/* what a generation names */
#define K_LOAD 1
#define K_SAVE 2
/* an index load's status (OffloadIndex Entry::Status) */
#define S_TICKETED 1
#define S_IN_FLIGHT 2
/* an index save: the dispatched bit */
#define SV_DISPATCHED 2
/* The names the trails print (mtype): how admit's ticket ends, finish's save, a
   Resolution, what a load record says (every leg ok; a leg failed; the state missed: R2),
   and what the drain finds of a save. */
mtype = { no_load, sent, sent_but_dropped, ticket_dropped, ticket_held };
mtype = { kv_save, kv_save_dropped, state_save };
mtype = { completed, failed, abandoned, reclaimed };
mtype = { restored, missed };
mtype = { released, released_and_stored, released_not_stored, stored, not_stored };
#define O_OK restored
#define O_FAILED failed
#define O_MISSED missed
#define R_COMPLETED completed
#define R_FAILED failed
#define R_ABANDONED abandoned
#define R_RECLAIMED reclaimed
/* SavePhase */
#define PH_REL 1
#define PH_STO 2
/* A rank's copy of a load: it may still write the slot and blocks (R9: until its one
   record, emitted after both legs joined), its record is queued for the next drain, done. */
#define L_OWES 1
#define L_QUEUED 2
#define L_DONE 3
/* A rank's copy of a save: the gather may still read the source (R13: `released` comes
   only after the synchronize that covers it), `released` merged and the put running, done. */
#define SR_READING 1
#define SR_PUTTING 2
#define SR_DONE 3

/* ================================================================== state */

/* what a key is */
byte last;                /* GenerationSource::last_issued: loads and saves draw from it (R3) */
byte kind[NG + 1];
byte lreq[NG + 1];        /* a load's request */
byte ladm[NG + 1];        /* a load's admission: it writes that admission's slot and blocks */
byte ssrc[NG + 1];        /* a save's source admission */
bit  sstate[NG + 1];      /* a state save: indexes the hash when stored */

/* OffloadIndex (R5: the one owner) */
byte ixs[NG + 1];         /* 0 (resolved, or never a load), S_TICKETED, S_IN_FLIGHT */
bit  ixo[NG + 1];         /* orphaned */
byte ixlive[NQ];          /* requests_: the request's live (not orphaned) load */
byte orphq[NA];           /* orphans in orphan-time order, oldest first */
byte norph;
bit  hash = 1;            /* the one state hash: indexed (an earlier lifetime stored it, R18) */
byte res[NG + 1];         /* the resolution queue: the kind queued for a key, 0 none */
bit  resorph[NG + 1];     /*   LoadResolution::orphaned */
bit  fgt[NG + 1];         /* forgotten_: resolved without its ranks; the group must drop it */
byte sxs[NG + 1];         /* saves_: 0, or SV_DISPATCHED */

/* TpQuorum (R3, R4). Tombstones are a bounded fast path in front of the index; the
   model's have always aged out, the case R3 must survive: every late record meets the index. */
bit  qp[NG + 1];          /* a pending entry */
byte qrep[NG + 1];        /* reported: a load's ranks; a save's `stored` phase */
bit  qfail[NG + 1];
bit  qmiss[NG + 1];
byte qrel[NG + 1];        /* a save's `released` phase */
bit  qrelset[NG + 1];
bit  qnotsto[NG + 1];
bit  qany[NG + 1];
byte dead;                /* dead_mask_ */
byte revived;             /* revived_mask_ */
byte revfrom[NR];         /* revived_from_ */

/* SettlementPump */
bit  wdead;               /* world_dead_ */
byte swept;               /* swept_through_ */
byte outrel[NG + 1];      /* the save settlements the next step hands out: 0, 1 ok, 2 not ok */
byte outsto[NG + 1];

/* Coordinator */
byte pk[NQ];              /* parked_: the load key the request waits on */
byte pka[NQ];             /*          its admission */
bit  pkd[NQ];             /*          dropped: already resolved, not in flight */
bit  pkt[NQ];             /*          its ticket not yet consumed (TICKET_WINDOW only) */
byte hold[NG + 1];        /* holding_: orphaned load -> torn-down admission */
bit  torn[NG + 1];        /* torn_down_keys_ */
bit  cs[NG + 1];          /* saves_: a save it sent */
bit  csrel[NG + 1];       /*         whose released phase settled */
byte css;                 /* state_saves_ of the hash */
/* AdmissionLedger */
byte nadm;
byte areq[NA + 1];
bit  abook[NA + 1];       /* on the books (not yet freed) */
bit  aend[NA + 1];
bit  awr[NA + 1];         /* writer_held */
byte asrc[NA + 1];        /* sources_held */
byte livea[NQ];

/* ranks */
typedef Rank {
  bit  up;                /* the process is alive; its writes and reads stop when it dies */
  byte l[NG + 1];         /* L_* per load key */
  byte s[NG + 1];         /* SR_* per save key */
  mtype lo[NG + 1];       /* within a step only: the record the drain finds (O_*) */
  mtype so[NG + 1];       /* within a step only: the save records the drain finds */
};
Rank rk[NR];
byte pend;                /* resolutions, forgotten keys and save settlements the next step
                             hands on (derived: the step's guard) */
byte owing;               /* loads a rank that is up still writes (derived, likewise) */
byte queued;              /* load records queued for the next drain (derived, likewise) */
byte saving;              /* saves a rank that is up still reads or puts (derived, likewise) */

/* the environment */
bit  quiet;               /* the clients stopped: no admit, teardown, finish, death or return */
byte ncrash;
byte nrest;

/* choose_ranks' cursor and the watch's choice: they live across the choices of one step,
   so they are state (pan restores only the state when it backtracks); 0 between steps */
byte ck, ckr, ckg;
bit  cfound;
byte notice;              /* the dead ranks this step's watch sees (a pidfd may tell late) */

/* scratch of one d_step, not part of the state */
hidden byte ab, act, now1, ok1, sto1, sv1, dok, rv, tmp;
hidden byte ri, cr, cg, cq, dr, dg, wr, oi, mg, sg, fr, fg;
hidden byte fa, g1, a1, q1;

/* (An inline's arguments are pasted as text: pass a variable, not an expression, where
   the inline negates or combines it.) */

/* ================================================================== checks */

/* P4: no rank that is up may still write load g's slot and blocks. */
inline no_writer(g) {
  for (cr : 0 .. NR - 1) {
    assert(!(rk[cr].up && rk[cr].l[g] == L_OWES))
  }
}

#define IN_FLIGHT(g) (kind[g] == K_LOAD && ixs[g] == S_IN_FLIGHT)
#define SAVE_IN_FLIGHT(g) (kind[g] == K_SAVE && sxs[g] == SV_DISPATCHED)

/* ================================================================== OffloadIndex */

/* resolve(): the one place a load ends (R5): the tables, the hash on a genuine miss only
   (R7: an abandon or a reclaim never retracts), the resolution queue, and last the
   orphan's slot (R8). */
inline ix_resolve(g, k, missing) {
  printf("  index: g%d %e\n", g, k);
  assert(ixs[g] != 0);                     /* P1: an outstanding load, resolved once */
  if
  :: ixo[g] ->
     oi = 0;
     do
     :: orphq[oi] == g -> break
     :: else -> oi++
     od;
     do
     :: oi + 1 < norph -> orphq[oi] = orphq[oi + 1]; oi++
     :: else -> break
     od;
     norph--;
     orphq[norph] = 0
  :: else -> ixlive[lreq[g]] = 0
  fi;
  if
  :: missing -> COVER(12); hash = 0
  :: else
  fi;
  res[g] = k;
  pend++;
  resorph[g] = ixo[g];
  if
  :: ixo[g] -> no_writer(g)                /* P4: the orphan's slot goes back now (R8) */
  :: else
  fi;
  ixs[g] = 0;
  ixo[g] = 0
}

/* settle(): a merged settlement; a key not in flight is late (R3). */
inline ix_settle(g, ok, miss) {
  if
  :: IN_FLIGHT(g) && ixo[g] -> COVER(9); ix_resolve(g, (ok -> R_COMPLETED : R_FAILED), !ok && miss)
  :: IN_FLIGHT(g) && !ixo[g] -> ix_resolve(g, (ok -> R_COMPLETED : R_FAILED), !ok && miss)
  :: else
  fi
}

/* fail(key), the engine's: never an orphan (R8: its ranks may still write its slot). */
inline ix_fail(g) {
  if
  :: IN_FLIGHT(g) && !ixo[g] -> fgt[g] = 1; pend++; ix_resolve(g, R_FAILED, 0)
  :: else
  fi
}

/* orphan(key) (R8): the index takes custody of the slot; the request's re-admission is
   no longer blocked. rv: whether it was in flight. */
inline ix_orphan(g) {
  if
  :: IN_FLIGHT(g) && !ixo[g] ->
     ixo[g] = 1;
     ixlive[lreq[g]] = 0;
     orphq[norph] = g;
     norph++;
     rv = 1
  :: else -> rv = 0
  fi
}

/* settle_save(): `released` changes nothing in the index; `stored` resolves the save, and
   a state save every rank stored indexes its hash (R5). Not in flight: late (R3). */
inline ix_settle_save(g, ph, ok) {
  if
  :: SAVE_IN_FLIGHT(g) && ph == PH_STO ->
     sxs[g] = 0;
     if
     :: ok && sstate[g] -> COVER(13); hash = 1
     :: else
     fi
  :: else
  fi
}

/* ================================================================== the pump's sink */

inline sink_load(g, ok, miss) {
  assert(IN_FLIGHT(g));                    /* P1: the quorum settles only what the index
                                              holds in flight: once, never late (R3, R4) */
  ix_settle(g, ok, miss)
}

/* Every save settlement goes back to the engine, which frees sources on `released`. */
inline sink_save(g, ph, ok) {
  assert(SAVE_IN_FLIGHT(g));
  ix_settle_save(g, ph, ok);
  if
  :: ph == PH_REL -> assert(outrel[g] == 0); outrel[g] = (ok -> 1 : 2)   /* once per phase */
  :: else -> assert(outsto[g] == 0); outsto[g] = (ok -> 1 : 2)
  fi;
  pend++
}

/* ================================================================== TpQuorum */

/* absent_for(g): the dead, and the returned whose return came after g was issued (R4). */
inline absent(g) {
  ab = dead;
  for (ri : 0 .. NR - 1) {
    if
    :: (revived & BIT(ri)) && g < revfrom[ri] -> ab = ab | BIT(ri)
    :: else
    fi
  }
}

inline clear_entry(g) {
  qp[g] = 0; qrep[g] = 0; qfail[g] = 0; qmiss[g] = 0;
  qrel[g] = 0; qrelset[g] = 0; qnotsto[g] = 0; qany[g] = 0
}

/* A load entry every rank reported for (or stood in for) leaves the table; the caller
   then sinks (ok1, sto1). */
inline q_close_load(g) {
  ok1 = !qfail[g];
  sto1 = qmiss[g];
  clear_entry(g);
  now1 = 1
}

/* R4: failure-dominant; a duplicate never counts twice; a failure is never overwritten.
   R2: the miss rides the one record. */
inline q_add_load(r, g, o) {
  qfail[g] = qfail[g] || (o != O_OK);
  qmiss[g] = qmiss[g] || (o == O_MISSED);
  if
  :: qrep[g] & BIT(r)                      /* duplicate_reports */
  :: else ->
     qrep[g] = qrep[g] | BIT(r);
     if
     :: qrep[g] == ALL -> q_close_load(g)
     :: else
     fi
  fi
}

inline q_merge_load(r, g, o) {
  absent(g);
  act = 0;
  now1 = 0;
  if
  :: ab & BIT(r) ->                        /* dead_rank_reports: dead, or an older incarnation (R4) */
     COVER(2);
     printf("  quorum: dropped, rank %d does not count for g%d\n", r, g)
  :: else ->
     if
     :: qp[g] -> act = 1
     :: !qp[g] && !IN_FLIGHT(g) ->         /* late (R3): the index is the truth */
        COVER(1);
        printf("  quorum: late, g%d is not in flight\n", g)
     :: else ->
        if
        :: (ab | BIT(r)) == ALL -> act = 2 /* the one report it waits for: settles, no entry */
        :: else ->
           qp[g] = 1;
           qrep[g] = ab;
           qfail[g] = (ab != 0);           /* a dead rank's stand-in is a failure, never a miss */
           act = 1
        fi
     fi
  fi;
  if
  :: act == 1 ->
     if
     :: revived & BIT(r) -> COVER(17)      /* a returned rank counts for a later key */
     :: else
     fi;
     q_add_load(r, g, o)
  :: act == 2 -> COVER(3); ok1 = (o == O_OK && ab == 0); sto1 = (o == O_MISSED); now1 = 1
  :: else
  fi;
  if
  :: now1 -> sink_load(g, ok1, sto1)
  :: else
  fi
}

/* advance_save (R4): `released` once every rank released (a dead one reads nothing);
   `stored` after it, once every rank reported, ok if every live rank stored and one did. */
inline q_advance_save(g) {
  if
  :: !qrelset[g] && qrel[g] == ALL -> qrelset[g] = 1; sink_save(g, PH_REL, 1)
  :: else
  fi;
  if
  :: qrep[g] == ALL && qrelset[g] ->
     sto1 = qany[g] && !qnotsto[g];
     if
     :: sto1 -> COVER(21)                  /* stored */
     :: qany[g] && qnotsto[g] -> COVER(11) /* not stored: one live rank's put failed */
     :: else
     fi;
     clear_entry(g);
     sink_save(g, PH_STO, sto1)
  :: else
  fi
}

inline q_merge_save(r, g, ph, ok) {
  absent(g);
  act = 0;
  if
  :: ab & BIT(r)
  :: else ->
     if
     :: qp[g] -> act = 1
     :: !qp[g] && !SAVE_IN_FLIGHT(g) -> COVER(19)   /* late (R3) */
     :: else -> qp[g] = 1; qrep[g] = ab; qrel[g] = ab; act = 1
     fi
  fi;
  if
  :: act && ph == PH_REL ->
     if
     :: qrel[g] & BIT(r) -> act = 0
     :: else -> qrel[g] = qrel[g] | BIT(r)
     fi
  :: act && ph == PH_STO ->
     qnotsto[g] = qnotsto[g] || !ok;
     qany[g] = qany[g] || ok;
     if
     :: qrep[g] & BIT(r) -> act = 0
     :: else -> qrep[g] = qrep[g] | BIT(r)
     fi
  :: else
  fi;
  if
  :: act -> q_advance_save(g)
  :: else
  fi
}

/* mark_rank_dead (R4): every pending key not yet heard from the rank gets a stand-in, a
   failed load record or a released save (neutral for stored). A key that only waited on
   this rank settles now; one still waiting on a live rank waits, since that rank may
   still be writing. Keys nobody reported are not pending: see settle_if_unowed. */
inline q_mark_dead(r) {
  if
  :: dead & BIT(r)                         /* idempotent */
  :: else ->
     dead = dead | BIT(r);
     for (mg : 1 .. NG) {
       if
       :: qp[mg] && kind[mg] == K_LOAD && !(qrep[mg] & BIT(r)) ->
          qrep[mg] = qrep[mg] | BIT(r);
          qfail[mg] = 1;
          now1 = 0;
          if
          :: qrep[mg] == ALL -> COVER(4); q_close_load(mg)
          :: else
          fi;
          if
          :: now1 -> sink_load(mg, ok1, sto1)
          :: else
          fi
       :: qp[mg] && kind[mg] == K_SAVE && !((qrep[mg] & qrel[mg]) & BIT(r)) ->
          COVER(18);
          qrep[mg] = qrep[mg] | BIT(r);
          qrel[mg] = qrel[mg] | BIT(r);
          q_advance_save(mg)
       :: else
       fi
     }
  fi
}

/* settle_if_unowed (R4): a key in flight that nobody reported and no live rank owes any
   more (every rank counted for it died, at once or in a rolling restart) settles: a load
   failed, never missed; a save released and not stored. */
inline q_settle_if_unowed(g) {
  absent(g);
  if
  :: !qp[g] && kind[g] == K_LOAD && ab == ALL -> COVER(5); sink_load(g, 0, 0)
  :: !qp[g] && kind[g] == K_SAVE && ab == ALL -> COVER(6); sink_save(g, PH_REL, 1); sink_save(g, PH_STO, 0)
  :: else
  fi
}

/* mark_rank_alive (R4): the rank counts again only for generations from `first` on. */
inline q_mark_alive(r, first) {
  if
  :: dead & BIT(r) ->
     dead = dead & ~BIT(r);
     revfrom[r] = first;
     revived = revived | BIT(r)
  :: else
  fi
}

/* ================================================================== SettlementPump */

/* forget_resolved (R3): keys the index resolved without their ranks leave the group, so
   their later records are late. Every pump entry point starts with it. */
inline forget_resolved() {
  for (fg : 1 .. NG) {
    if
    :: fgt[fg] -> fgt[fg] = 0; pend--; clear_entry(fg)
    :: else
    fi
  }
}

/* settle_unowed: every load and save in flight is offered to settle_if_unowed (R4). */
inline settle_unowed() {
  for (sg : 1 .. NG) {
    if
    :: IN_FLIGHT(sg) || SAVE_IN_FLIGHT(sg) -> q_settle_if_unowed(sg)
    :: else
    fi
  }
  swept = last
}

inline pump_mark_dead(r) {
  forget_resolved();
  q_mark_dead(r);
  wdead = (dead == ALL);
#ifndef STRANDED_BUG
  settle_unowed()                          /* R4: what no live rank owes settles now */
#else
  skip                                     /* the bug: a key every counted rank died for waits */
#endif
}

inline pump_mark_alive(r) {
  printf("watch: rank %d back, counted from g%d\n", r, last + 1);
#ifndef ALIVE_WITHOUT_SWEEP
  /* R4: the returning rank does not count for keys issued while every rank was dead, so
     they settle now, before the world is alive again and the step's sweep passes them by. */
  if
  :: wdead && last != swept -> forget_resolved(); settle_unowed()
  :: else
  fi;
#endif
  q_mark_alive(r, last + 1);
  wdead = (dead == ALL)
}

/* ================================================================== Coordinator */

/* AdmissionLedger::free_if_idle (R8): one Freed, the moment the admission ended and
   nothing writes or reads its blocks and slot; it leaves the books with it. */
inline free_if_idle(a) {
  if
  :: abook[a] && aend[a] && !awr[a] && asrc[a] == 0 ->
     printf("  Freed admission %d\n", a);
     assert(livea[areq[a]] != a);          /* P3: never the request's running admission */
     for (fg : 1 .. NG) {                  /* P4: nothing that is up writes or reads it */
       for (fr : 0 .. NR - 1) {
         assert(!(rk[fr].up && kind[fg] == K_LOAD && ladm[fg] == a && rk[fr].l[fg] == L_OWES));
         assert(!(rk[fr].up && kind[fg] == K_SAVE && ssrc[fg] == a && rk[fr].s[fg] == SR_READING))
       }
     }
     abook[a] = 0                          /* P3: once; the final check: every ended one */
  :: else
  fi
}

/* teardown(id) (R8): the request's live admission ends. A parked request's load is
   orphaned and the admission is freed only once that load ended; it never unparks. */
inline teardown(q) {
  fa = livea[q];
  if
  :: fa == 0                               /* nothing live: a second teardown frees nothing */
  :: else ->
     printf("teardown request %d (admission %d)\n", q, fa);
     livea[q] = 0;
     aend[fa] = 1;
     if
     :: pk[q] != 0 ->
        g1 = pk[q];
        pk[q] = 0;
        pka[q] = 0;
        pkd[q] = 0;
        ix_orphan(g1);
        if
        :: rv -> hold[g1] = fa; awr[fa] = 1
        :: else -> COVER(10); torn[g1] = 1; free_if_idle(fa)   /* it resolved already: unparks nobody */
        fi
     :: else -> free_if_idle(fa)
     fi
  fi
}

/* The request resumes (or recomputes) in its own blocks and slot. */
inline unpark(q, g) {
  printf("  unpark request %d (g%d %e)\n", q, g, res[g]);
  assert(ladm[g] == pka[q] && livea[q] == pka[q]);   /* P5: its running admission's load */
  if
  :: res[g] == R_COMPLETED -> COVER(15)
  :: else
  fi;
  if
  :: norph > 0 && lreq[orphq[0]] == q -> COVER(16)   /* its earlier admission's orphan waits still */
  :: else
  fi;
  no_writer(g);                            /* P4: no rank still writes what it now uses */
  pk[q] = 0;
  pka[q] = 0;
  pkd[q] = 0
}

inline on_resolution(g) {
  if
  :: resorph[g] ->                         /* a torn-down admission's load ended (R8) */
     if
     :: hold[g] != 0 ->
        a1 = hold[g];
        COVER(20);
        assert(a1 == ladm[g]);             /* P5: an orphan frees only its own admission */
        hold[g] = 0;
        awr[a1] = 0;
        free_if_idle(a1)
     :: else
     fi
  :: else ->
     q1 = lreq[g];
     if
     :: pk[q1] == g -> unpark(q1, g)
     :: else ->
        assert(torn[g]);                   /* P1: a load nobody waits on, or a second unpark */
        torn[g] = 0
     fi
  fi;
  res[g] = 0;
  pend--;
  resorph[g] = 0
}

/* on_save: the source goes back on `released` (early release), never later than stored. */
inline on_save(g, ph, ok) {
  if
  :: cs[g] ->
     assert(ph != PH_REL || ok);           /* every rank in the model confirms its release */
     tmp = (ph == PH_REL) || !csrel[g];
     if
     :: ph == PH_REL -> csrel[g] = 1
     :: else ->
        if
        :: sstate[g] -> css--
        :: else
        fi;
        cs[g] = 0;
        csrel[g] = 0
     fi;
     if
     :: tmp ->
        if
        :: ph == PH_REL && SAVE_IN_FLIGHT(g) -> COVER(14)   /* released, not yet stored */
        :: else
        fi;
        a1 = ssrc[g];
        asrc[a1]--;
        free_if_idle(a1)
     :: else
     fi
  :: else
  fi
}

/* ------------------------------------------------------------------ the step */

/* A death or a return the watch has not seen yet. */
#define WATCH_DUE_R(r) ((r < NR) && ((rk[r].up && (dead & BIT(r))) || (!rk[r].up && !(dead & BIT(r)))))
#define WATCH_DUE (WATCH_DUE_R(0) || WATCH_DUE_R(1) || WATCH_DUE_R(2))

/* A step has something to do (a step with nothing to do changes nothing; leaving it out
   lets the end state be reached). */
#define STEP_DUE (owing > 0 || queued > 0 || saving > 0 || pend > 0 || (wdead && last != swept))

/* What the step's drain finds (TpQuorum::drain takes a snapshot of every lane queue).
   A rank that still writes a load may go on writing, may have emitted its record just
   after the snapshot (it stops writing; the next step drains it), or its record is in the
   snapshot: ok, failed, or missed (R2: the state verdict rides the one record). A rank
   reading a save's source may go on reading, or has released, and maybe stored too; one
   putting may have stored. Only rank 0 reports a failure, a miss or a put that did not
   store: the merge is failure-dominant (R4), so one such record decides it, and the
   ranks are alike. A record a rank queued before it died is still drained: it counts if
   the watch has not seen the death yet, and is dropped at the gate if it has. */
inline choose_ranks() {
  for (ck : 0 .. NR - 1) {                 /* the watch sees a death now, or at a later step */
    if
    :: !rk[ck].up && !(dead & BIT(ck)) ->
       if
       :: notice = notice | BIT(ck)
       :: skip
       fi
    :: else
    fi
  };
  ck = 0;
  do
  :: d_step {                              /* the next rank copy that may have news */
       cfound = 0;
       do
       :: ck >= NR * NG -> break
       :: else ->
          ckr = ck / NG;
          ckg = ck % NG + 1;
          ck++;
          cfound = (rk[ckr].l[ckg] == L_QUEUED) ||
                   (rk[ckr].up && (rk[ckr].l[ckg] == L_OWES ||
                                   rk[ckr].s[ckg] == SR_READING || rk[ckr].s[ckg] == SR_PUTTING));
          if
          :: cfound -> break
          :: else
          fi
       od
     };
     if
     :: !cfound -> break
     :: else
     fi;
     if
     :: rk[ckr].l[ckg] == L_OWES ->
        if
        :: skip
        :: rk[ckr].l[ckg] = L_QUEUED; owing--; queued++
        :: rk[ckr].lo[ckg] = O_OK
        :: ckr == 0 -> rk[ckr].lo[ckg] = O_FAILED
        :: ckr == 0 -> rk[ckr].lo[ckg] = O_MISSED
        fi
     :: rk[ckr].l[ckg] == L_QUEUED && ((dead | notice) & BIT(ckr)) ->
        rk[ckr].lo[ckg] = O_OK             /* its rank is marked dead first: the gate drops it */
     :: rk[ckr].l[ckg] == L_QUEUED && !((dead | notice) & BIT(ckr)) ->
        if
        :: rk[ckr].lo[ckg] = O_OK
        :: ckr == 0 -> rk[ckr].lo[ckg] = O_FAILED
        :: ckr == 0 -> rk[ckr].lo[ckg] = O_MISSED
        fi
     :: else
     fi;
     if
     :: rk[ckr].s[ckg] == SR_READING ->
        if
        :: skip
        :: rk[ckr].so[ckg] = released
        :: rk[ckr].so[ckg] = released_and_stored
        :: ckr == 0 -> rk[ckr].so[ckg] = released_not_stored
        fi
     :: rk[ckr].s[ckg] == SR_PUTTING ->
        if
        :: skip
        :: rk[ckr].so[ckg] = stored
        :: ckr == 0 -> rk[ckr].so[ckg] = not_stored
        fi
     :: else
     fi
  od;
  ck = 0;                                  /* the choice is in lo and so: reset the cursor */
  ckr = 0;
  ckg = 0;
  cfound = 0
}

/* TpQuorum::drain: the snapshot, rank by rank, each record merged as it comes (R20: a
   lane's records in order, none lost; R1: one record per load, two per save). */
inline drain() {
  for (dr : 0 .. NR - 1) {
    for (dg : 1 .. NG) {
      if
      :: rk[dr].lo[dg] != 0 ->
         printf("  drain: rank %d, load g%d: %e\n", dr, dg, rk[dr].lo[dg]);
         if
         :: rk[dr].l[dg] == L_OWES -> owing--
         :: else -> queued--
         fi;
         rk[dr].l[dg] = L_DONE;
         q_merge_load(dr, dg, rk[dr].lo[dg]);
         rk[dr].lo[dg] = 0
      :: else
      fi;
      if
      :: rk[dr].so[dg] != 0 ->
         printf("  drain: rank %d, save g%d: %e\n", dr, dg, rk[dr].so[dg]);
         tmp = (rk[dr].s[dg] == SR_READING);   /* `released` first, then `stored` */
         sv1 = (rk[dr].so[dg] != released);    /* a `stored` record too */
         if
         :: sv1 -> rk[dr].s[dg] = SR_DONE; saving--
         :: else -> rk[dr].s[dg] = SR_PUTTING
         fi;
         if
         :: tmp -> q_merge_save(dr, dg, PH_REL, 1)
         :: else
         fi;
         if
         :: sv1 ->
            dok = (rk[dr].so[dg] == released_and_stored || rk[dr].so[dg] == stored);
            q_merge_save(dr, dg, PH_STO, dok)
         :: else
         fi;
         rk[dr].so[dg] = 0
      :: else
      fi
    }
  }
}

/* ShmEngine::watch, before each step: a rank process that is gone is marked dead, at this
   step or a later one (notice); an incarnation that attached since is marked alive for the
   keys issued from now on (an attach seen late is an attach made later). What a dead rank
   left queued is drained after it is marked, and dropped at the quorum's gate (in-process
   lane queues keep it; ShmEngine empties the rings first: the same outcome). */

inline watch() {
  for (wr : 0 .. NR - 1) {
    if
    :: (notice & BIT(wr)) && !rk[wr].up && !(dead & BIT(wr)) ->
       printf("watch: rank %d gone, mark_rank_dead\n", wr);
       pump_mark_dead(wr)
    :: else
    fi;
    if
    :: rk[wr].up && (dead & BIT(wr)) -> pump_mark_alive(wr)   /* a later attach, if later */
    :: else
    fi
  };
  notice = 0
}

/* Coordinator::step: pump.step (forget, the sweep of keys dispatched while every rank is
   dead, the drain, the index's resolutions), then each resolution, each save settlement,
   and the Freed events (handed out as they fell due above). */
inline coord_step() {
  printf("step\n");
  forget_resolved();
  if
  :: wdead && last != swept -> COVER(7); settle_unowed()
  :: else
  fi;
  drain();
  for (cg : 1 .. NG) {
    if
    :: res[cg] != 0 -> on_resolution(cg)
    :: else
    fi
  }
  for (cg : 1 .. NG) {
    if
    :: outrel[cg] != 0 -> sv1 = (outrel[cg] == 1); outrel[cg] = 0; pend--; on_save(cg, PH_REL, sv1)
    :: else
    fi;
    if
    :: outsto[cg] != 0 -> sv1 = (outsto[cg] == 1); outsto[cg] = 0; pend--; on_save(cg, PH_STO, sv1)
    :: else
    fi
  };
  skip
}

/* ------------------------------------------------------------------ the client's calls */

/* The transport: a frame reaches every rank the engine holds live (ShmEngine sends to
   every attached rank's ring); a rank whose process died unnoticed gets it in a ring
   nobody reads, and a returned one gets only what is sent after the watch noticed it. */
inline send_load(g) {
  for (cr : 0 .. NR - 1) {
    if
    :: !(dead & BIT(cr)) && rk[cr].up -> rk[cr].l[g] = L_OWES; owing++
    :: else
    fi
  }
}

inline send_save(g) {
  for (cr : 0 .. NR - 1) {
    if
    :: !(dead & BIT(cr)) && rk[cr].up -> rk[cr].s[g] = SR_READING; saving++
    :: else
    fi
  }
}

/* admit(request): how the plan and the ticket end */
#define A_NOLOAD no_load             /* the plan loads nothing: compute now */
#define A_SENT sent                  /* a joint load: dispatched, and the transport took it */
#define A_DROPPED sent_but_dropped   /*   dispatched, and the transport dropped it: failed now */
#define A_ABANDONED ticket_dropped   /*   the ticket dropped undispatched (R6; docs/model.md) */
#define A_HELD ticket_held           /*   the ticket held for later (TICKET_WINDOW) */

inline request_load(q) {
  last++;
  kind[last] = K_LOAD;
  lreq[last] = q;
  ladm[last] = nadm;                       /* its own admission's slot: never slot_in_use (R8) */
  ixs[last] = S_TICKETED;
  ixlive[q] = last
}

/* Coordinator::admit: start (a live admission that was not ended is ended first, as by
   teardown), the plan, request_load (R3: a fresh generation), and the ticket consumed at
   once by exactly one of dispatch or abandon (R6); the request parks on its key. */
inline admit(q, how) {
  printf("admit request %d: %e\n", q, how);
  teardown(q);
  nadm++;
  areq[nadm] = q;
  abook[nadm] = 1;
  livea[q] = nadm;
  if
  :: how != A_NOLOAD && ixlive[q] == 0 ->  /* load_in_flight: the only refusal that could
                                              apply, and an orphan never causes it (R8) */
     request_load(q);
     pk[q] = last;
     pka[q] = nadm;
     pkd[q] = (how == A_DROPPED || how == A_ABANDONED);
     if
     :: how == A_ABANDONED -> ix_resolve(last, R_ABANDONED, 0)   /* R7: never a miss */
     :: how == A_HELD -> pkt[q] = 1
     :: else ->
        ixs[last] = S_IN_FLIGHT;           /* dispatch(): the index accepts its records now */
        if
        :: how == A_SENT -> send_load(last)
        :: else -> ix_fail(last)           /* no rank saw it: failed now, unparks next step */
        fi
     fi
  :: else
  fi
}

/* TICKET_WINDOW: the held ticket is dispatched (and sent) or dropped, later. */
inline dispatch_held(q) {
  printf("dispatch the held ticket of request %d\n", q);
  pkt[q] = 0;
  ixs[pk[q]] = S_IN_FLIGHT;
  send_load(pk[q]);
  skip
}

inline drop_held(q) {
  printf("drop the held ticket of request %d\n", q);
  pkt[q] = 0;
  pkd[q] = 1;
  ix_resolve(pk[q], R_ABANDONED, 0)
}

/* finish(request): how its save goes */
#define F_KV kv_save                 /* a KV save of the admission's blocks */
#define F_KV_DROP kv_save_dropped    /*   the transport dropped it */
#define F_STATE state_save           /* a state save of its slot, sent only while the hash is
                                        neither served nor being saved (deduplication) */

/* Coordinator::finish: the admission ends; its save, ticketed and dispatched at once (R6),
   holds the source until every rank released it; then the admission is freed. */
inline finish(q, how) {
  fa = livea[q];
  printf("finish request %d (admission %d): %e\n", q, fa, how);
  livea[q] = 0;
  aend[fa] = 1;
  last++;
  kind[last] = K_SAVE;
  ssrc[last] = fa;
  sstate[last] = (how == F_STATE);
  sxs[last] = SV_DISPATCHED;
  if
  :: how == F_KV_DROP ->                   /* no rank saw it: released, never stored */
     ix_settle_save(last, PH_REL, 1);
     ix_settle_save(last, PH_STO, 0)
  :: else ->
     asrc[fa]++;
     cs[last] = 1;
     if
     :: sstate[last] -> css++
     :: else
     fi;
     send_save(last)
  fi;
  free_if_idle(fa)
}

/* tick: reclaim (R8) takes the oldest orphan once its age passed the timeout. The timer is
   nondeterministic under the assumption reclaim rests on: the timeout is longer than any
   rank that is up takes to write a load it took (docs/model.md). */
#ifdef EAGER_RECLAIM
#define RECLAIMABLE(g) (1)
#else
#define RECLAIMABLE(g) (!(rk[0].up && rk[0].l[g] == L_OWES) && \
                        !(NR > 1 && rk[1 % NR].up && rk[1 % NR].l[g] == L_OWES) && \
                        !(NR > 2 && rk[2 % NR].up && rk[2 % NR].l[g] == L_OWES))
#endif

inline tick() {
  g1 = orphq[0];
  printf("tick: reclaim orphan g%d\n", g1);
  COVER(8);
  fgt[g1] = 1;
  pend++;
  ix_resolve(g1, R_RECLAIMED, 0)
}

/* ------------------------------------------------------------------ the ranks' lives */

inline crash(r) {
  printf("rank %d dies\n", r);
  rk[r].up = 0;
  ncrash++;
  for (cg : 1 .. NG) {
    if
    :: rk[r].l[cg] == L_OWES -> rk[r].l[cg] = L_DONE; owing--      /* its writes stop with it */
    :: else
    fi;
    if
    :: rk[r].s[cg] == SR_READING || rk[r].s[cg] == SR_PUTTING -> rk[r].s[cg] = SR_DONE; saving--
    :: else
    fi
  };
  skip
}

/* A new incarnation attaches (ShmRank): a fresh process, nothing of the old one's. */
inline attach(r) {
  printf("rank %d attaches again\n", r);
  rk[r].up = 1;
  nrest++;
  for (cg : 1 .. NG) {
    assert(rk[r].l[cg] != L_QUEUED);       /* the step that marked it dead drained them */
    rk[r].l[cg] = 0;
    rk[r].s[cg] = 0
  };
  skip
}

/* The engine's timing is free: a rank may come back whenever, keys may be issued between
   its attach and the watch that notices it. (Before mark_rank_alive swept keys issued while
   every rank was dead, the model had to forbid that window, RETURN_AFTER_SWEEP, and that
   restriction hid a stranded load: docs/model.md, what the model found.) */
#define RETURNING_R(r) ((r < NR) && rk[r].up && (dead & BIT(r)))
#define RETURNING (RETURNING_R(0) || RETURNING_R(1) || RETURNING_R(2))
#ifdef RETURN_AFTER_SWEEP
#define RETURN_OK (!(wdead && last != swept))
#define ISSUE_OK (!(wdead && RETURNING))
#else
#define RETURN_OK (1)
#define ISSUE_OK (1)
#endif

/* ================================================================== the options */

#define RANK_LIFE(r) \
  :: d_step { (r < NR) && !quiet && rk[r].up && ncrash < MAXCRASH -> crash(r) } \
  :: d_step { (r < NR) && !quiet && !rk[r].up && (dead & BIT(r)) && nrest < MAXREST && RETURN_OK -> attach(r) }

/* Request 0 is admitted first: the two are alike. */
#define CAN_ADMIT(q) (!quiet && pk[q] == 0 && nadm < NA && (q == 0 || nadm > 0))
#define CAN_LOAD (last < NG && hash && ISSUE_OK)
#ifdef LOADS_ONLY
#define CAN_FINISH(q) (0)       /* no saves: the control's trail is about a load */
#else
#define CAN_FINISH(q) (!quiet && livea[q] != 0 && pk[q] == 0 && last < NG && ISSUE_OK)
#endif

/* A request's calls. The transport drops a load only of request 0, the engine drops a
   ticket and the transport a save only of request 1: each path meets all the others, at
   a fraction of the states. A running request ends by finish (its save) or by its next
   admit (which ends it as teardown does); teardown itself is exercised where it matters,
   on a parked request, whose load it orphans. */
#ifdef TICKET_WINDOW
#define HELD_OPTIONS(q) \
  :: d_step { CAN_ADMIT(q) && CAN_LOAD -> admit(q, A_HELD) } \
  :: d_step { pkt[q] -> dispatch_held(q) } \
  :: d_step { pkt[q] -> drop_held(q) }
#else
#define HELD_OPTIONS(q)
#endif

#define REQUEST_OPTIONS(q) \
  :: d_step { CAN_ADMIT(q) -> admit(q, A_NOLOAD) } \
  :: d_step { CAN_ADMIT(q) && CAN_LOAD -> admit(q, A_SENT) } \
  :: d_step { q == 0 && CAN_ADMIT(q) && CAN_LOAD -> admit(q, A_DROPPED) } \
  :: d_step { q == 1 && CAN_ADMIT(q) && CAN_LOAD -> admit(q, A_ABANDONED) } \
  HELD_OPTIONS(q) \
  :: d_step { !quiet && pk[q] != 0 && !pkt[q] -> teardown(q) } \
  :: d_step { CAN_FINISH(q) -> finish(q, F_KV) } \
  :: d_step { q == 1 && CAN_FINISH(q) -> finish(q, F_KV_DROP) } \
  :: d_step { CAN_FINISH(q) && !hash && css == 0 -> finish(q, F_STATE) }

/* ================================================================== the end state */

/* P2. Nothing can move: the clients stopped, and the protocol did all it will do alone.
   Whatever is left now is stranded. */
inline final_check() {
  for (cq : 0 .. NQ - 1) {
    assert(pk[cq] == 0)                    /* no request parked on a load that never ends */
  }
  for (cg : 1 .. NG) {
    assert(kind[cg] != K_LOAD || ixs[cg] == 0);   /* every load resolved */
    assert(kind[cg] != K_SAVE || sxs[cg] == 0);   /* every save stored or failed */
    assert(!qp[cg] && res[cg] == 0 && !fgt[cg] && outrel[cg] == 0 && outsto[cg] == 0);
    assert(hold[cg] == 0 && !torn[cg] && !cs[cg])
  }
  assert(norph == 0 && pend == 0 && owing == 0 && queued == 0 && saving == 0 && !WATCH_DUE);
  for (cg : 1 .. NA) {
    assert(cg > nadm || !aend[cg] || !abook[cg])  /* every admission that ended was freed */
  };
  skip
}

active proctype protocol() {
  for (cr : 0 .. NR - 1) { rk[cr].up = 1 }
  do
  REQUEST_OPTIONS(0)
  REQUEST_OPTIONS(1)
  :: atomic { STEP_DUE || WATCH_DUE -> choose_ranks(); d_step { watch(); coord_step() } }
  :: d_step { norph > 0 && RECLAIMABLE(orphq[0]) -> tick() }
  RANK_LIFE(0)
  RANK_LIFE(1)
  RANK_LIFE(2)
  :: d_step { !quiet -> quiet = 1; printf("the clients stop\n") }
  :: timeout -> d_step { final_check() }; break
  od
}
