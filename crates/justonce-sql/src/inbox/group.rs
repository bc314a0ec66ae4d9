//! Shared commits ([`InboxOptions::share_commits`](super::InboxOptions::share_commits)):
//! concurrent [`Inbox::run_forward`] calls on one store claim their keys and write their
//! outbox rows in one commit, so that one flush of the disk serves many: on PostgreSQL one
//! statement over arrays, sent on its own (one round trip); on MariaDB and SQLite one
//! transaction.
//!
//! Group commit, not a timer: a call that finds fewer groups committing than allowed starts
//! a group at once, alone if need be. Calls that arrive while every allowed group commits
//! wait, and form the next group when one ends. Each call is answered after the commit that
//! holds it. A group that fails is run again one call at a time, as without sharing, so
//! that one bad call never fails another; a group whose commit lost its answer is read back
//! by its claim id, as a single run is.

use super::{Inbox, judge, pause_before_retry, random_claim_id};
use crate::backend::{Backend, ForwardFailed};
use crate::outbox::Message;
use crate::rows::{ClaimRow, NewOutboxRow, Stored};
use crate::shared::{Shared, driver_error};
use crate::wake::Forwards;
use justonce_core::{Claim, Error, Fingerprint, Identity, Key, Outcome};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::oneshot;

/// The most calls one shared commit holds.
pub(crate) const MOST_PER_GROUP: usize = 256;

/// The calls waiting for a shared commit, and how many groups are committing.
pub(crate) struct CommitQueue {
    queue: Mutex<Queue>,
    most_in_flight: usize,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<Call>,
    in_flight: usize,
}

/// One call of `run_forward` waiting for its commit.
struct Call {
    identity: Identity,
    fingerprint: Fingerprint,
    message: Message,
    answer: oneshot::Sender<Result<Outcome<()>, Error>>,
}

impl CommitQueue {
    /// A queue that lets `most_in_flight` groups commit at once (at least one).
    pub(crate) fn new(most_in_flight: usize) -> Self {
        Self {
            queue: Mutex::new(Queue::default()),
            most_in_flight: most_in_flight.max(1),
        }
    }

    /// Queues `call`; the group to commit if it starts one.
    fn join(&self, call: Call) -> Option<Vec<Call>> {
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        queue.waiting.push(call);
        if queue.in_flight < self.most_in_flight {
            queue.in_flight += 1;
            Some(queue.take())
        } else {
            None
        }
    }

    /// After a group has committed: the calls that came meanwhile, or none, and one group
    /// fewer in flight.
    fn next(&self) -> Option<Vec<Call>> {
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        if queue.waiting.is_empty() {
            queue.in_flight -= 1;
            None
        } else {
            Some(queue.take())
        }
    }
}

impl Queue {
    fn take(&mut self) -> Vec<Call> {
        let count = self.waiting.len().min(MOST_PER_GROUP);
        self.waiting.drain(..count).collect()
    }
}

/// Counts a group task out of the queue if it is dropped before it ends (it panicked, or
/// its runtime shut down), so that later calls start groups of their own. With no group
/// left in flight, nothing would take the calls that wait: they are dropped, and their
/// callers told that the commit's outcome is unknown, rather than left waiting.
struct InFlight<'a>(Option<&'a CommitQueue>);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(commits) = self.0.take() {
            let mut queue = commits.queue.lock().unwrap_or_else(PoisonError::into_inner);
            queue.in_flight -= 1;
            if queue.in_flight == 0 {
                queue.waiting.clear();
            }
        }
    }
}

/// Why a group did not commit.
enum GroupFailed {
    /// Nothing was committed.
    RolledBack(Error),
    /// The COMMIT was sent and its answer lost: the group's claims, if it happened.
    CommitUnknown(Vec<Claim>, Error),
}

impl GroupFailed {
    /// What becomes of each call of the failed group: a call that held its key in a group
    /// whose commit may have happened is read back by the group's claim id; any other runs
    /// as it would without sharing.
    fn fates(self, calls: usize) -> Vec<Fate> {
        match self {
            Self::RolledBack(error) => {
                tracing::debug!(%error, calls, "shared commit failed: one by one");
                (0..calls).map(|_| Fate::Alone).collect()
            }
            Self::CommitUnknown(claims, error) => {
                tracing::debug!(%error, calls, "shared commit lost its answer: reading back");
                claims
                    .into_iter()
                    .map(|claim| match claim {
                        Claim::First => Fate::ReadBack,
                        _ => Fate::Alone,
                    })
                    .collect()
            }
        }
    }
}

/// What became of one call of a group.
enum Fate {
    /// The group's commit settled it (or found its key's stored row unreadable).
    Answered(Result<Claim, Error>),
    /// Its key may have been claimed by a commit whose answer was lost: read back by the
    /// group's claim id.
    ReadBack,
    /// The group committed nothing of it, or did not see its key's holder: it runs as it
    /// would without sharing.
    Alone,
}

impl<DB: Backend> Inbox<DB> {
    /// [`Inbox::run_forward`] through a shared commit.
    pub(super) async fn forward_shared(
        &self,
        commits: &CommitQueue,
        identity: Identity,
        fingerprint: Fingerprint,
        message: Message,
    ) -> Result<Outcome<()>, Error> {
        let (answer, answered) = oneshot::channel();
        let call = Call {
            identity,
            fingerprint,
            message: message.with_current_trace(),
            answer,
        };
        // A task of its own: a caller that gives up waiting must not leave the others'
        // commit unfinished.
        if let Some(group) = commits.join(call) {
            tokio::spawn(commit_groups(Arc::clone(&self.shared), group));
        }
        answered.await.unwrap_or_else(|_| {
            Err(Error::CommitUnknown {
                source: "the shared commit's task ended before it answered".into(),
            })
        })
    }

    /// The inbox of `identity`'s consumer and scope on `shared`.
    fn of(shared: &Arc<Shared<DB>>, identity: &Identity) -> Self {
        Self {
            shared: Arc::clone(shared),
            consumer: identity.consumer.clone(),
            scope: identity.scope.clone(),
        }
    }
}

/// Commits `group`, then each group of the calls that came meanwhile, until none wait.
async fn commit_groups<DB: Backend>(shared: Arc<Shared<DB>>, mut group: Vec<Call>) {
    let Some(commits) = shared.commits.as_ref() else {
        return;
    };
    let mut in_flight = InFlight(Some(commits));
    loop {
        commit_group(&shared, group).await;
        match commits.next() {
            Some(next) => group = next,
            None => {
                in_flight.0 = None;
                return;
            }
        }
    }
}

/// Commits `calls` together, or one by one if that fails, and answers each.
async fn commit_group<DB: Backend>(shared: &Arc<Shared<DB>>, calls: Vec<Call>) {
    let claim_id = random_claim_id();
    // A call alone takes the path it takes without sharing: one statement on PostgreSQL.
    // A group takes one statement too where the database has one, else a transaction.
    let fates = if calls.len() == 1 {
        vec![Fate::Alone]
    } else if let Some(fates) = in_one_statement(shared, &calls, claim_id).await {
        fates
    } else {
        match in_one_transaction(shared, &calls, claim_id).await {
            Ok(claims) => claims.into_iter().map(Ok).map(Fate::Answered).collect(),
            Err(failed) => failed.fates(calls.len()),
        }
    };
    let mut forwarded = false;
    let mut rest = Vec::new();
    for (call, fate) in calls.into_iter().zip(fates) {
        let claim = match fate {
            Fate::Answered(claim) => claim,
            Fate::ReadBack => {
                rest.push((call, true));
                continue;
            }
            Fate::Alone => {
                rest.push((call, false));
                continue;
            }
        };
        let outcome = claim.map(|claim| match claim {
            Claim::First => Outcome::Processed(()),
            Claim::Duplicate => Outcome::Duplicate,
            Claim::KeyReused { stored, received } => Outcome::KeyReused { stored, received },
        });
        if let Ok(outcome) = &outcome {
            forwarded |= *outcome == Outcome::Processed(());
            // The relays are woken once for the group, below.
            Inbox::of(shared, &call.identity).settled(
                &call.identity,
                call.fingerprint,
                &Forwards::new(shared.as_ref(), false),
                outcome,
            );
        }
        // A caller that stopped waiting is no longer told.
        let _ = call.answer.send(outcome);
    }
    if forwarded {
        shared.wake_relays();
    }
    let alone = rest.into_iter().map(|(call, held)| async move {
        let inbox = Inbox::of(shared, &call.identity);
        let outcome = if held {
            pause_before_retry(1, true).await;
            inbox
                .forward_in_transactions(
                    &call.identity,
                    call.fingerprint,
                    &call.message,
                    Some((claim_id, ())),
                    1,
                )
                .await
        } else {
            inbox
                .forward_alone(&call.identity, call.fingerprint, &call.message)
                .await
        };
        // A call that forwarded has woken the relays after its commit.
        let _ = call.answer.send(outcome);
    });
    futures_util::future::join_all(alone).await;
}

/// Claims the keys of `calls` and writes the outbox rows of those it holds in one
/// statement committed on its own ([`Backend::claim_and_forward_many`]): what became of
/// each call, or `None` where the database has no such statement.
async fn in_one_statement<DB: Backend>(
    shared: &Arc<Shared<DB>>,
    calls: &[Call],
    claim_id: i64,
) -> Option<Vec<Fate>> {
    // Each key once, as its first call has it: that call claims it, and the later calls
    // of the key are judged against it.
    let mut places: HashMap<&Identity, usize> = HashMap::with_capacity(calls.len());
    let mut firsts: Vec<usize> = Vec::with_capacity(calls.len());
    let place_of: Vec<usize> = (calls.iter().enumerate())
        .map(|(index, call)| {
            *places.entry(&call.identity).or_insert_with(|| {
                firsts.push(index);
                firsts.len() - 1
            })
        })
        .collect();
    let claims: Vec<(ClaimRow<'_>, NewOutboxRow<'_>)> = firsts
        .iter()
        .map(|&index| {
            let call = &calls[index];
            let claim = ClaimRow {
                identity: &call.identity,
                fingerprint: &call.fingerprint,
                claim_id,
            };
            (claim, outbox_row(call))
        })
        .collect();
    let statement = DB::claim_and_forward_many(&shared.pool, &shared.sql, &claims)?;
    let failed = match statement.await {
        Ok(held) => {
            let fates = (calls.iter().enumerate()).map(|(index, call)| {
                let place = place_of[index];
                // A holder committed after the statement's snapshot: the call's key is not
                // this group's, and the call reads it as it would without sharing.
                let Some((stored_claim_id, fingerprint)) = held[place].clone() else {
                    return Fate::Alone;
                };
                let claim = Stored::decode(stored_claim_id, fingerprint).map(|stored| {
                    let holds = stored.claim_id == claim_id && firsts[place] == index;
                    judge(holds, stored.fingerprint, call.fingerprint)
                });
                Fate::Answered(claim)
            });
            return Some(fates.collect());
        }
        // The statement was its own commit: its answer may have been lost after the first
        // call of each key claimed it.
        Err(ForwardFailed::Statement(error)) if DB::is_commit_unknown(&error) => {
            let claims = (0..calls.len())
                .map(|index| {
                    if firsts[place_of[index]] == index {
                        Claim::First
                    } else {
                        Claim::Duplicate
                    }
                })
                .collect();
            GroupFailed::CommitUnknown(claims, driver_error::<DB>(error))
        }
        Err(ForwardFailed::Statement(error) | ForwardFailed::Connect(error)) => {
            GroupFailed::RolledBack(driver_error::<DB>(error))
        }
        Err(ForwardFailed::Invalid(reason)) => {
            GroupFailed::RolledBack(Error::InvalidStatement(reason))
        }
    };
    Some(failed.fates(calls.len()))
}

/// The outbox row that forwards `call`'s message.
fn outbox_row(call: &Call) -> NewOutboxRow<'_> {
    NewOutboxRow {
        scope: call.identity.scope.as_str(),
        key: call.identity.key.as_str(),
        destination: &call.message.destination,
        payload: &call.message.payload,
        headers: call.message.headers_json(),
    }
}

/// Claims the keys of `calls` and writes the outbox rows of those it holds, in one
/// transaction, where the database has no statement for it: one statement per scope and consumer for the claims (as
/// [`Inbox::claim_many`]), one for the rows where the database takes it.
async fn in_one_transaction<DB: Backend>(
    shared: &Arc<Shared<DB>>,
    calls: &[Call],
    claim_id: i64,
) -> Result<Vec<Claim>, GroupFailed> {
    // By scope and consumer, then (in the claim) by key: every group takes its row locks
    // in one order, so groups sharing keys wait for each other instead of deadlocking. The
    // sort is stable: of one key's calls, the first to come claims it.
    let mut order: Vec<usize> = (0..calls.len()).collect();
    let owner = |index: &usize| {
        let identity = &calls[*index].identity;
        (identity.scope.as_str(), identity.consumer.as_str())
    };
    order.sort_by_key(owner);
    let _writer = shared.queue_writer().await;
    let mut tx = (crate::pool::begin(&shared.pool).await)
        .map_err(|error| GroupFailed::RolledBack(driver_error::<DB>(error)))?;
    // Each call is in one partition, which overwrites its place.
    let mut claims = vec![Claim::Duplicate; calls.len()];
    let written = async {
        for partition in order.chunk_by(|a, b| owner(a) == owner(b)) {
            let inbox = Inbox::of(shared, &calls[partition[0]].identity);
            let keys: Vec<&Key> = partition
                .iter()
                .map(|&index| &calls[index].identity.key)
                .collect();
            let fingerprints: Vec<Fingerprint> = partition
                .iter()
                .map(|&index| calls[index].fingerprint)
                .collect();
            let claimed = inbox
                .claim_fingerprinted(&mut tx, &keys, &fingerprints, claim_id)
                .await?;
            for (&index, claim) in partition.iter().zip(claimed) {
                claims[index] = claim;
            }
        }
        let rows: Vec<NewOutboxRow<'_>> = calls
            .iter()
            .zip(&claims)
            .filter(|(_, claim)| **claim == Claim::First)
            .map(|(call, _)| outbox_row(call))
            .collect();
        if !rows.is_empty() {
            DB::forward_many(&mut tx, &shared.sql, &rows).await?;
        }
        Ok::<_, Error>(())
    }
    .await;
    if let Err(error) = written {
        // Rolled back here, not on drop, so that the write lock is gone before the next
        // writer in the queue begins.
        if let Err(rollback) = tx.rollback().await {
            tracing::debug!(error = %rollback, "rolling a failed shared commit back");
        }
        return Err(GroupFailed::RolledBack(error));
    }
    match tx.commit().await {
        Ok(()) => Ok(claims),
        Err(error) if DB::is_commit_unknown(&error) => Err(GroupFailed::CommitUnknown(
            claims,
            driver_error::<DB>(error),
        )),
        Err(error) => Err(GroupFailed::RolledBack(driver_error::<DB>(error))),
    }
}
