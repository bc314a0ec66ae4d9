//! Wakes the relays after a commit that wrote outbox rows, without a NOTIFY inside the
//! committing transaction: PostgreSQL takes one lock for the whole database when a
//! transaction that notified commits, so notifying receivers would commit one at a time.
//! This process's relays are woken at once; relays in other processes by a NOTIFY sent
//! on its own, at most one per interval ([`NOTIFY_EVERY`] by default), however many
//! commits it covers.

use crate::backend::Backend;
use crate::shared::Shared;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::Duration;
use tokio::sync::watch;

/// The shortest time between two NOTIFYs of one process by default: a burst of commits
/// shares one. The first commit after a quiet spell is notified at once.
pub(crate) const NOTIFY_EVERY: Duration = Duration::from_millis(5);

/// Counts the NOTIFYs sent to wake relays in other processes.
pub const RELAY_NOTIFICATIONS: &str = "justonce_relay_notifications_total";

/// No NOTIFY is being sent or waited for.
const IDLE: u8 = 0;
/// The notifier runs, and every commit so far is covered by its next NOTIFY.
const SENDING: u8 = 1;
/// The notifier runs, and a commit came after its last NOTIFY began: it sends one more.
const AGAIN: u8 = 2;

/// What this process's commits of outbox rows tell the relays.
pub(crate) struct RelayWake {
    /// Bumped after each such commit; each relay of this process watches it.
    commits: watch::Sender<u64>,
    notifier: Arc<AtomicU8>,
    /// The shortest time between two NOTIFYs.
    every: Duration,
}

impl RelayWake {
    pub(crate) fn new(every: Duration) -> Self {
        Self {
            commits: watch::Sender::new(0),
            notifier: Arc::new(AtomicU8::new(IDLE)),
            every,
        }
    }

    /// What a relay of this process waits on.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.commits.subscribe()
    }

    /// After a commit that wrote outbox rows: wakes this process's relays, and has a
    /// NOTIFY on `channel` sent soon, outside any transaction.
    pub(crate) fn committed<DB: Backend>(&self, pool: &sqlx::Pool<DB>, channel: &str) {
        self.commits
            .send_modify(|count| *count = count.wrapping_add(1));
        if !DB::NOTIFIES {
            return;
        }
        let before = self
            .notifier
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |state| {
                Some(if state == IDLE { SENDING } else { AGAIN })
            })
            .unwrap_or(AGAIN);
        if before == IDLE {
            let notifier = Arc::clone(&self.notifier);
            tokio::spawn(notify_until_quiet(
                pool.clone(),
                channel.to_owned(),
                notifier,
                self.every,
            ));
        }
    }

    /// [`RelayWake::committed`] for a rare change (a replay): its NOTIFY is sent before
    /// this returns, so that a process that exits next (the command line) still sends it.
    pub(crate) async fn committed_now<DB: Backend>(&self, pool: &sqlx::Pool<DB>, channel: &str) {
        self.commits
            .send_modify(|count| *count = count.wrapping_add(1));
        if DB::NOTIFIES {
            notify::<DB>(pool, channel).await;
        }
    }
}

tokio::task_local! {
    /// The run whose work runs on this task: [`Forwards::note`] tells it of a row forwarded.
    static RUN: Forwards;
}

/// Whether the work of one run (or batch) forwarded a row in its transaction, which the
/// run then announces after its commit. The work tells it through a task-local value, so
/// that `Inbox::forward` keeps taking the transaction alone.
#[derive(Clone)]
pub(crate) struct Forwards {
    /// The address of the store's shared state: a row forwarded to another store inside
    /// this run is not this run's to announce.
    store: usize,
    forwarded: Arc<AtomicBool>,
}

impl Forwards {
    /// A run on the store whose shared state is `store`; `forwarded` when it is known to
    /// forward a row, as `run_forward` does.
    pub(crate) fn new<DB: Backend>(store: &Shared<DB>, forwarded: bool) -> Self {
        Self {
            store: std::ptr::from_ref(store).addr(),
            forwarded: Arc::new(AtomicBool::new(forwarded)),
        }
    }

    /// Runs a try of the run's work, telling it of this run.
    pub(crate) fn around<F: Future>(&self, work: F) -> impl Future<Output = F::Output> {
        RUN.scope(self.clone(), work)
    }

    /// Notes that the work of a run on `store` forwards a row; false when no run on it is
    /// running on this task: the row is then announced at its own transaction's commit.
    pub(crate) fn note<DB: Backend>(store: &Shared<DB>) -> bool {
        let store = std::ptr::from_ref(store).addr();
        RUN.try_with(|run| {
            let ours = run.store == store;
            if ours {
                run.forwarded.store(true, Ordering::Relaxed);
            }
            ours
        })
        .unwrap_or(false)
    }

    /// Whether a try of the work forwarded a row: the relays are woken when the run commits.
    pub(crate) fn any(&self) -> bool {
        self.forwarded.load(Ordering::Relaxed)
    }
}

/// Sends a NOTIFY, then one more after each pause in which a commit came, until a pause
/// passes without one.
async fn notify_until_quiet<DB: Backend>(
    pool: sqlx::Pool<DB>,
    channel: String,
    notifier: Arc<AtomicU8>,
    every: Duration,
) {
    let mut dropped = IdleIfDropped(Some(Arc::clone(&notifier)));
    loop {
        // A commit from here on may be missed by this NOTIFY: it asks for the next.
        notifier.store(SENDING, Ordering::Release);
        notify::<DB>(&pool, &channel).await;
        tokio::time::sleep(every).await;
        if notifier
            .compare_exchange(SENDING, IDLE, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            dropped.0 = None;
            return;
        }
    }
}

/// Sets the notifier idle when its task is dropped before it returns (its runtime shut
/// down), so that a later commit starts another instead of counting on a task now gone.
struct IdleIfDropped(Option<Arc<AtomicU8>>);

impl Drop for IdleIfDropped {
    fn drop(&mut self) {
        if let Some(notifier) = self.0.take() {
            notifier.store(IDLE, Ordering::Release);
        }
    }
}

/// One NOTIFY. A failure is only logged: the relays' poll finds the rows all the same.
async fn notify<DB: Backend>(pool: &sqlx::Pool<DB>, channel: &str) {
    match DB::notify_relays(pool, channel).await {
        Ok(()) => metrics::counter!(RELAY_NOTIFICATIONS).increment(1),
        Err(error) => tracing::debug!(%error, "waking other relays failed: they poll"),
    }
}
