//! The harness's broker: delivers the workload's keys to worker processes, keeps each
//! delivery until the worker acknowledges it, delivers again what a dead worker or a refusal
//! left unacknowledged, and kills workers when the scenario says so.

use crate::Rng;
use justonce_tests::WORKER_FAILPOINT;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::mpsc;

/// The name of workload key `index`; fixed width, so that the index reads back from it.
pub fn key_name(index: u32) -> String {
    format!("key-{index:07}")
}

pub fn key_index(name: &str) -> Option<u32> {
    name.strip_prefix("key-")?.parse().ok()
}

/// The worker processes a scenario runs.
pub struct Workers {
    /// The database URL the workers connect to.
    pub url: String,
    /// The run's table prefix.
    pub prefix: String,
    /// `harness-worker`'s mode.
    pub mode: String,
    /// Worker processes running at once.
    pub processes: usize,
    /// Keys each process works on at once.
    pub lanes: usize,
    /// Deliveries each process holds unacknowledged at most.
    pub window: usize,
    /// Transactions `Inbox::run` tries per key (`InboxOptions::max_attempts`).
    pub max_attempts: u32,
}

/// The faults the broker itself injects, or hears of.
pub enum Faults {
    None,
    /// SIGKILL a worker this many times and start another: every fourth time at its
    /// failpoint (a correct worker's only), otherwise at a random point of the run.
    Kills(usize),
    /// Faults injected elsewhere (a proxy, a database restart): when each began and when it
    /// ended; recovery counts from its beginning to the first commit read after its end.
    /// The run is not over before `expected` of them were heard of, or their sender is
    /// gone; `progress` counts acknowledgements, for an injector that acts on progress.
    External {
        heard: mpsc::UnboundedReceiver<(Instant, Instant)>,
        expected: usize,
        progress: Arc<AtomicUsize>,
    },
}

/// How the first acknowledgement of a key read.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Ack {
    /// Processed, with the number of times the work ran.
    Processed(u32),
    Duplicate,
}

/// What the broker saw: the record the check compares with the database.
pub struct Record {
    /// Whether each key of the workload was delivered at least once.
    pub attempted: Vec<bool>,
    /// The first acknowledgement of each key.
    pub acknowledged: Vec<Option<Ack>>,
    /// Keys refused at least once with `commit-unknown`.
    pub unknown: Vec<bool>,
    /// Deliveries beyond the workload's: of keys a dead worker or a refusal left.
    pub redeliveries: u64,
    /// Faults injected or heard of.
    pub faults: usize,
    /// Of the kills, those at the worker's failpoint.
    pub at_failpoint: u64,
    /// From each fault to the next commit acknowledged after it.
    pub recovery: Vec<Duration>,
    /// Acknowledgements as processed, and as duplicates.
    pub processed: u64,
    pub duplicates: u64,
    /// Refusals (`nack`), by reason.
    pub refusals: BTreeMap<String, u64>,
    /// Whether every delivery was acknowledged before the deadline.
    pub drained: bool,
}

enum Event {
    Line {
        process: u64,
        line: String,
        at: Instant,
    },
    Exited {
        process: u64,
    },
}

struct Process {
    child: Child,
    stdin: Option<ChildStdin>,
    /// Unacknowledged deliveries: key, and how many of its deliveries.
    in_flight: HashMap<u32, u32>,
    held: usize,
    killed: bool,
    /// Started with its failpoint armed, and not yet past it.
    armed: bool,
}

/// A fault whose recovery is being waited for.
struct Awaiting {
    began: Instant,
    /// A commit counts if read after this, from a process at least this new.
    after: Instant,
    from_process: u64,
}

/// The first line a process armed to stop at its failpoint prints, `None` if it closes its
/// output first; `name` says whose it is if none comes within a minute.
pub async fn failpoint_line(stdout: ChildStdout, name: &str) -> Result<Option<String>, String> {
    tokio::time::timeout(
        Duration::from_secs(60),
        BufReader::new(stdout).lines().next_line(),
    )
    .await
    .map_err(|_| format!("{name} did not reach its failpoint in 60 s"))?
    .map_err(|e| e.to_string())
}

/// Where the sibling binaries of this one are.
pub fn sibling(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the harness's own path");
    exe.with_file_name(name)
}

struct Broker<'a> {
    workers: &'a Workers,
    events: mpsc::UnboundedSender<Event>,
    processes: HashMap<u64, Process>,
    /// The process in each slot; a killed process's replacement takes its slot.
    slots: Vec<u64>,
    next_process: u64,
    /// Deliveries still to send; `true` for a redelivery.
    pending: VecDeque<(u32, bool)>,
    record: Record,
    acks: usize,
    awaiting: Vec<Awaiting>,
    crashes: usize,
    /// The process that has just said it stopped at its failpoint.
    paused: Option<u64>,
}

/// Delivers `plan` (workload key indices, in order) to the workers until every delivery is
/// acknowledged or `deadline` passes, injecting `faults`.
pub async fn deliver(
    workers: &Workers,
    keys: usize,
    plan: Vec<u32>,
    mut faults: Faults,
    rng: &mut Rng,
    deadline: Duration,
) -> Result<Record, String> {
    let (events, mut incoming) = mpsc::unbounded_channel();
    let deliveries = plan.len();
    let mut broker = Broker {
        workers,
        events,
        processes: HashMap::new(),
        slots: Vec::new(),
        next_process: 0,
        pending: plan.into_iter().map(|key| (key, false)).collect(),
        record: Record {
            attempted: vec![false; keys],
            acknowledged: vec![None; keys],
            unknown: vec![false; keys],
            redeliveries: 0,
            faults: 0,
            at_failpoint: 0,
            recovery: Vec::new(),
            processed: 0,
            duplicates: 0,
            refusals: BTreeMap::new(),
            drained: false,
        },
        acks: 0,
        awaiting: Vec::new(),
        crashes: 0,
        paused: None,
    };
    for _ in 0..workers.processes {
        let id = broker.spawn(false)?;
        broker.slots.push(id);
    }
    // Kill points: after random numbers of acknowledgements, plus a few random milliseconds
    // so that the other lanes are caught at any point of their transactions. A kill at the
    // failpoint takes the next point's place.
    let kills = match &faults {
        Faults::Kills(count) => *count,
        Faults::None | Faults::External { .. } => 0,
    };
    // Whether the `done`th kill's replacement is armed, so that the next kill is at its
    // failpoint: every fourth kill is, as long as the worker is the correct one.
    let arm_after =
        |done: usize| workers.mode == "correct" && (done + 1).is_multiple_of(4) && done < kills;
    let mut kill_points: VecDeque<usize> = match &faults {
        Faults::Kills(count) => {
            let mut points: Vec<usize> = (0..*count)
                .map(|_| 1 + rng.below(deliveries as u64 - 1) as usize)
                .collect();
            points.sort_unstable();
            points.into()
        }
        Faults::None | Faults::External { .. } => VecDeque::new(),
    };
    let mut kill_at: Option<tokio::time::Instant> = None;
    // Whether every external fault expected was heard of, and whether their injector is gone.
    let mut heard_all = !matches!(faults, Faults::External { .. });
    let mut injector_gone = heard_all;
    let deadline = tokio::time::Instant::now() + deadline;
    loop {
        broker.dispatch().await;
        if let Some(process) = broker.paused.take() {
            kill_points.pop_front();
            let slot = broker.slot_of(process).expect("a live armed process");
            broker
                .kill(slot, arm_after(broker.record.faults + 1))
                .await?;
            broker.record.at_failpoint += 1;
        }
        // An armed worker is left to reach its failpoint, unless nothing is left to give it.
        let armed_pending = broker.armed() && !broker.drained();
        if kill_at.is_none()
            && !armed_pending
            && kill_points.front().is_some_and(|at| broker.acks >= *at)
        {
            kill_points.pop_front();
            kill_at = Some(tokio::time::Instant::now() + Duration::from_millis(rng.below(10)));
        }
        let external = match &mut faults {
            Faults::External {
                heard,
                expected,
                progress,
            } => {
                progress.store(broker.acks, Ordering::Relaxed);
                heard_all |= broker.record.faults >= *expected;
                Some(heard)
            }
            _ => None,
        };
        if broker.drained() && kill_points.is_empty() && kill_at.is_none() && heard_all {
            broker.record.drained = true;
            break;
        }
        tokio::select! {
            fault = async { external?.recv().await }, if !injector_gone => match fault {
                Some((began, ended)) => {
                    broker.record.faults += 1;
                    broker.awaiting.push(Awaiting { began, after: ended, from_process: 0 });
                }
                None => (heard_all, injector_gone) = (true, true),
            },
            event = incoming.recv() => broker.handle(event.expect("the broker holds a sender"))?,
            () = async { tokio::time::sleep_until(kill_at.expect("armed")).await }, if kill_at.is_some() => {
                kill_at = None;
                let slot = rng.below(broker.slots.len() as u64) as usize;
                broker.kill(slot, arm_after(broker.record.faults + 1)).await?;
            }
            () = tokio::time::sleep_until(deadline) => break,
        }
    }
    broker.stop().await;
    Ok(broker.record)
}

impl Broker<'_> {
    /// Starts a worker process; `armed`, it stops at its failpoint.
    fn spawn(&mut self, armed: bool) -> Result<u64, String> {
        let workers = self.workers;
        let (lanes, attempts) = (workers.lanes.to_string(), workers.max_attempts.to_string());
        let mut command = Command::new(sibling("harness-worker"));
        if armed {
            command.env("JUSTONCE_FAILPOINT", WORKER_FAILPOINT);
        }
        let mut child = command
            .args([
                &workers.url,
                &workers.prefix,
                &workers.mode,
                &lanes,
                &attempts,
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start harness-worker: {e}"))?;
        let id = self.next_process;
        self.next_process += 1;
        let stdout = child.stdout.take().expect("piped");
        let events = self.events.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let at = Instant::now();
                let _ = events.send(Event::Line {
                    process: id,
                    line,
                    at,
                });
            }
            let _ = events.send(Event::Exited { process: id });
        });
        let stdin = child.stdin.take();
        self.processes.insert(
            id,
            Process {
                child,
                stdin,
                in_flight: HashMap::new(),
                held: 0,
                killed: false,
                armed,
            },
        );
        Ok(id)
    }

    fn slot_of(&self, process: u64) -> Option<usize> {
        self.slots.iter().position(|id| *id == process)
    }

    /// Whether a live process is armed and has not yet reached its failpoint.
    fn armed(&self) -> bool {
        self.slots.iter().any(|id| self.processes[id].armed)
    }

    /// SIGKILLs the process in `slot` and starts its replacement at once, `armed` or not.
    /// What it held is delivered again once its last words are read (see
    /// [`Event::Exited`]).
    async fn kill(&mut self, slot: usize, armed: bool) -> Result<(), String> {
        let id = self.slots[slot];
        let process = self.processes.get_mut(&id).expect("a live slot");
        process.killed = true;
        process.stdin = None;
        let began = Instant::now();
        process
            .child
            .start_kill()
            .map_err(|e| format!("cannot kill a worker: {e}"))?;
        let replacement = self.spawn(armed)?;
        self.slots[slot] = replacement;
        self.record.faults += 1;
        self.awaiting.push(Awaiting {
            began,
            after: began,
            from_process: replacement,
        });
        Ok(())
    }

    /// Tops every live process up to its window.
    async fn dispatch(&mut self) {
        for &id in &self.slots {
            let process = self.processes.get_mut(&id).expect("a live slot");
            let mut batch = String::new();
            while process.held < self.workers.window {
                let Some((key, again)) = self.pending.pop_front() else {
                    break;
                };
                self.record.attempted[key as usize] = true;
                self.record.redeliveries += u64::from(again);
                *process.in_flight.entry(key).or_default() += 1;
                process.held += 1;
                batch.push_str(&key_name(key));
                batch.push('\n');
            }
            if let (false, Some(stdin)) = (batch.is_empty(), process.stdin.as_mut()) {
                // A dead process cannot take them; they are delivered again when it is reaped.
                let _ = stdin.write_all(batch.as_bytes()).await;
            }
        }
    }

    fn drained(&self) -> bool {
        self.pending.is_empty() && self.processes.values().all(|p| p.held == 0)
    }

    fn handle(&mut self, event: Event) -> Result<(), String> {
        match event {
            Event::Line { process, line, at } => self.line(process, &line, at),
            Event::Exited { process } => {
                let mut gone = self.processes.remove(&process).expect("a known process");
                for (key, count) in gone.in_flight.drain() {
                    self.pending
                        .extend(std::iter::repeat_n((key, true), count as usize));
                }
                if !gone.killed {
                    // Exited on its own: a worker that failed. Replace it, within reason.
                    self.crashes += 1;
                    if self.crashes > 20 {
                        return Err("workers keep failing".to_owned());
                    }
                    let slot = self.slot_of(process);
                    // Armed if it was: its failpoint kill is still to come.
                    let replacement = self.spawn(gone.armed)?;
                    if let Some(slot) = slot {
                        self.slots[slot] = replacement;
                    }
                }
                tokio::spawn(async move { gone.child.wait().await });
                Ok(())
            }
        }
    }

    fn line(&mut self, process: u64, line: &str, at: Instant) -> Result<(), String> {
        let words: Vec<&str> = line.split(' ').collect();
        let (key, ack) = match words.as_slice() {
            ["ready"] => return Ok(()),
            ["paused", name] if *name == WORKER_FAILPOINT => {
                let holder = self.processes.get_mut(&process).expect("a known process");
                if holder.armed && !holder.killed {
                    holder.armed = false;
                    self.paused = Some(process);
                    // Its key committed: a commit that recovers from the faults before it.
                    self.recovered(process, at);
                }
                return Ok(());
            }
            ["ack", "processed", key, runs] => {
                (*key, Some(Ack::Processed(runs.parse().unwrap_or(0))))
            }
            ["ack", "duplicate", key] => (*key, Some(Ack::Duplicate)),
            ["nack", key, reason] => {
                *self
                    .record
                    .refusals
                    .entry((*reason).to_owned())
                    .or_default() += 1;
                (*key, None)
            }
            _ => return Err(format!("a worker said {line:?}")),
        };
        let index = key_index(key).ok_or_else(|| format!("a worker named key {key:?}"))?;
        let holder = self.processes.get_mut(&process).expect("a known process");
        match holder.in_flight.get_mut(&index) {
            Some(count) if *count > 1 => *count -= 1,
            Some(_) => drop(holder.in_flight.remove(&index)),
            None => {
                return Err(format!(
                    "{key} was not delivered to the worker that answered"
                ));
            }
        }
        holder.held -= 1;
        match ack {
            Some(ack) => {
                self.acks += 1;
                let first = &mut self.record.acknowledged[index as usize];
                first.get_or_insert(ack);
                if ack == Ack::Duplicate {
                    self.record.duplicates += 1;
                } else {
                    self.record.processed += 1;
                    self.recovered(process, at);
                }
            }
            None => {
                if words[2] == "commit-unknown" {
                    self.record.unknown[index as usize] = true;
                }
                self.pending.push_back((index, true));
            }
        }
        Ok(())
    }

    /// Counts a commit by `process` at `at` as the recovery from each fault it follows.
    fn recovered(&mut self, process: u64, at: Instant) {
        let recovery = &mut self.record.recovery;
        self.awaiting.retain(|fault| {
            let recovered = at >= fault.after && process >= fault.from_process;
            if recovered {
                recovery.push(at - fault.began);
            }
            !recovered
        });
    }

    /// Ends the workers: standard input closed, so that each finishes its keys in flight,
    /// killed if one lingers.
    async fn stop(&mut self) {
        for process in self.processes.values_mut() {
            process.stdin = None;
        }
        for (_, mut process) in self.processes.drain() {
            let waited = tokio::time::timeout(Duration::from_secs(10), process.child.wait()).await;
            if waited.is_err() {
                let _ = process.child.kill().await;
            }
        }
    }
}
