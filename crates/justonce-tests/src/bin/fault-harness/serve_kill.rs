//! `serve-kill`: signed webhooks posted to `justonce serve`, the shipped binary, by senders
//! that retry each event until it is answered 2xx, as webhook senders do, while the server
//! is SIGKILLed at random moments and started again; every fourth time it is killed at its
//! failpoint instead, with an event stored and not yet answered. A tenth of the events are
//! sent a second time after their 2xx, as senders do. The server forwards each event to a
//! receiver inside the harness with the event's key.
//!
//! An event answered 2xx is acknowledged: it must reach the receiver, and every request
//! for it must carry the same key, so that a receiver acting once per `Idempotency-Key`
//! acts once.
//!
//! The server, the senders and the check here serve `slow-clients` and `slow-target` too.

use crate::broker::{key_index, key_name, sibling};
use crate::report::{Report, receiver_effects, workload_index};
use crate::{Args, Rng};
use hmac::{Hmac, Mac};
use justonce_http::receiver::FAILPOINT;
use justonce_tests::{Received, Sink, TestBackend};
use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};
use tokio::task::JoinHandle;

/// The source's signing secret.
const SECRET: &str = "the harness signing secret";

/// Senders posting at once.
const SENDERS: usize = 8;

/// Where the relay logs, by the logger's target: its breaker's changes are logged at info.
const RELAY_LOG: &str = "justonce_sql::relay";

/// Five relay leases: a row a killed server took is sent again well within it.
const STALLED: Duration = Duration::from_secs(10);

pub async fn serve_kill<DB: TestBackend>(
    args: &Args,
    rng: &mut Rng,
    title: String,
) -> Result<Report, String> {
    let events = args.size(1_000, 10_000);
    let kills = args.size(10, 100);
    let deadline = Instant::now() + Duration::from_secs(args.size(120, 1200) as u64);
    // The server uses its default table names: it gets a database of its own.
    let database = DB::create_database(&format!("harness_serve_{}", std::process::id())).await;
    let sink = Sink::start().await;
    let mut server = Server::configure(&database, &sink.url(), args.mode == "answer-before-store")?;
    let result = send_while_killing(events, kills, deadline, rng, &mut server).await;
    let (sent, received, stored) =
        settle::<DB>(&database, &[&sink], &mut server, result, deadline).await?;
    let mut report = check(title, events, &sent, &received, &stored, event_key);
    report.faults = sent.killed_at.len();
    report.recovery = sent
        .killed_at
        .iter()
        .filter_map(|(began, dead)| {
            let next = sent.answered.iter().find(|at| *at > dead)?;
            Some(*next - *began)
        })
        .collect();
    report.details.splice(
        0..0,
        [
            (
                format!("kills at the failpoint ({FAILPOINT})"),
                sent.at_failpoint,
            ),
            ("sent again after a 2xx, on purpose".to_owned(), sent.again),
        ],
    );
    Ok(report)
}

/// After the senders: waits until every acknowledged event reached a receiver among
/// `sinks` and the server's outbox holds nothing unsent, reads the outbox's keys, stops the
/// server and drops its database. Returns what was sent, every request the receivers got,
/// and the outbox's keys.
pub async fn settle<DB: TestBackend>(
    database: &str,
    sinks: &[&Sink],
    server: &mut Server,
    mut result: Result<Sent, String>,
    deadline: Instant,
) -> Result<(Sent, Vec<Received>, Vec<String>), String> {
    let store = sqlx::Pool::<DB>::connect(database)
        .await
        .map_err(|e| format!("cannot read the server's database: {e}"));
    let mut stored = Ok(Vec::new());
    if let (Ok(sent), Ok(store)) = (&mut result, &store) {
        sent.drained &= reached::<DB>(sinks, store, &sent.acknowledged, deadline).await;
        stored = DB::texts(
            store,
            format!("SELECT {} FROM justonce_outbox", DB::quoted("key")),
        )
        .await
        .map_err(|e| format!("cannot read the server's outbox: {e}"));
    }
    let stopped = server.stop().await;
    let received = sinks.iter().flat_map(|sink| sink.received()).collect();
    let _ = std::fs::remove_file(&server.config);
    if let Ok(store) = store {
        store.close().await;
    }
    DB::drop_database(database).await;
    let sent = result?;
    stopped?;
    Ok((sent, received, stored?))
}

/// The check of a run of webhooks: every event is required at a receiver, under the key
/// `event_key` gives it; an event stored twice in the server's outbox, or answered as new
/// twice, acted twice whatever the receivers saw. The details count the requests at the
/// receivers and the answers; faults and recovery are the caller's.
pub fn check(
    title: String,
    events: usize,
    sent: &Sent,
    received: &[Received],
    stored: &[String],
    event_key: impl Fn(u32) -> String,
) -> Report {
    let (effects, repeated) = receiver_effects(received, event_key);
    let mut rows = vec![0i64; events];
    for index in stored
        .iter()
        .filter_map(|key| key_index(key.split_once(':')?.1))
    {
        if let Some(count) = rows.get_mut(index as usize) {
            *count += 1;
        }
    }
    let effects = effects
        .into_iter()
        .map(|(name, count)| {
            let index = key_index(&name).map(|index| index as usize);
            let stored = index.and_then(|index| rows.get(index)).copied();
            let accepted = index.and_then(|index| sent.accepted.get(index)).copied();
            let most = count
                .max(stored.unwrap_or(0))
                .max(i64::from(accepted.unwrap_or(0)));
            (name, most)
        })
        .collect();
    let attempted = vec![true; events];
    let mut report = Report::compare(
        title,
        sent.tries.len(),
        &attempted,
        &sent.acknowledged,
        effects,
    );
    report.redeliveries = Some(sent.tries.iter().sum::<u64>() - sent.tries.len() as u64);
    report.drained = sent.drained;
    report.details = [
        ("requests at the receiver".to_owned(), received.len() as u64),
        ("requests repeated at the receiver".to_owned(), repeated),
    ]
    .into_iter()
    .chain(
        sent.answers
            .iter()
            .map(|(answer, count)| (format!("answered {answer}"), *count)),
    )
    .collect();
    report
}

/// The key the server forwards event `index` of source `demo` with.
pub fn event_key(index: u32) -> String {
    format!("demo:{}", key_name(index))
}

/// What the senders saw.
pub struct Sent {
    /// Tries of each send, in plan order.
    pub tries: Vec<u64>,
    pub acknowledged: Vec<bool>,
    /// How often each event was answered as new.
    pub accepted: Vec<u32>,
    /// Every 2xx, when it was read.
    pub answered: Vec<Instant>,
    /// When each event was first answered 2xx.
    pub first_answered: Vec<Option<Instant>>,
    /// How long each answered try took, from the request's start to its answer.
    pub latencies: Vec<Duration>,
    /// Answers by status and, for a 2xx, the body's `status`; `no answer` when the
    /// connection failed.
    pub answers: BTreeMap<String, u64>,
    again: u64,
    /// When each kill was sent, and when the process was gone.
    killed_at: Vec<(Instant, Instant)>,
    /// How many of the kills were at the failpoint.
    at_failpoint: u64,
    /// Whether every send was answered 2xx and the receiver got every event before the
    /// deadline.
    pub drained: bool,
}

/// The state the sender tasks share: a plan of sends, each posted until it is answered
/// 2xx, and what the answers were.
#[derive(Default)]
pub struct Senders {
    plan: Mutex<VecDeque<(usize, u32)>>,
    /// Where event `index` is posted: `hooks[index % hooks.len()]`.
    hooks: Vec<String>,
    /// When the sends start and how far apart: send `n` starts no earlier than
    /// `start + n * gap`. Without it, as fast as the server answers.
    pace: Option<(Instant, Duration)>,
    acknowledged: Mutex<Vec<bool>>,
    accepted: Mutex<Vec<u32>>,
    tries: Mutex<Vec<u64>>,
    answered: Mutex<Vec<Instant>>,
    first_answered: Mutex<Vec<Option<Instant>>>,
    latencies: Mutex<Vec<Duration>>,
    answers: Mutex<BTreeMap<String, u64>>,
    acks: AtomicUsize,
}

impl Senders {
    /// Senders of `plan` (event indices below `events`, in send order) to `hooks`, spread
    /// evenly over `spread` when it is given.
    pub fn new(
        plan: Vec<u32>,
        events: usize,
        hooks: Vec<String>,
        spread: Option<Duration>,
    ) -> Arc<Self> {
        let sends = plan.len();
        Arc::new(Self {
            plan: Mutex::new(plan.into_iter().enumerate().collect()),
            hooks,
            pace: spread.map(|spread| (Instant::now(), spread / sends.max(1) as u32)),
            acknowledged: Mutex::new(vec![false; events]),
            accepted: Mutex::new(vec![0; events]),
            tries: Mutex::new(vec![0; sends]),
            first_answered: Mutex::new(vec![None; events]),
            ..Self::default()
        })
    }

    /// Starts `count` sender tasks; each returns false if the deadline came before its
    /// sends were answered.
    pub fn spawn(self: &Arc<Self>, count: usize, deadline: Instant) -> Vec<JoinHandle<bool>> {
        let client = reqwest::Client::new();
        (0..count)
            .map(|_| {
                let (state, client) = (Arc::clone(self), client.clone());
                tokio::spawn(async move { state.send(&client, deadline).await })
            })
            .collect()
    }

    /// Waits for the sender tasks and returns what they saw.
    pub async fn finish(&self, senders: Vec<JoinHandle<bool>>) -> Result<Sent, String> {
        let mut all_sent = true;
        for sender in senders {
            all_sent &= sender.await.map_err(|e| e.to_string())?;
        }
        fn take<T: Default>(shared: &Mutex<T>) -> T {
            std::mem::take(&mut *shared.lock().unwrap())
        }
        Ok(Sent {
            tries: take(&self.tries),
            acknowledged: take(&self.acknowledged),
            accepted: take(&self.accepted),
            answered: take(&self.answered),
            first_answered: take(&self.first_answered),
            latencies: take(&self.latencies),
            answers: take(&self.answers),
            again: 0,
            killed_at: Vec::new(),
            at_failpoint: 0,
            drained: all_sent,
        })
    }

    /// Takes sends from the plan and posts each until it is answered 2xx; false if the
    /// deadline came first.
    async fn send(&self, client: &reqwest::Client, deadline: Instant) -> bool {
        loop {
            let Some((send, index)) = self.plan.lock().unwrap().pop_front() else {
                return true;
            };
            if let Some((start, gap)) = self.pace {
                tokio::time::sleep_until((start + gap * send as u32).into()).await;
            }
            let url = &self.hooks[index as usize % self.hooks.len()];
            let body = format!(r#"{{"id":"{}","n":{index}}}"#, key_name(index));
            let signature = signature(body.as_bytes());
            loop {
                if Instant::now() >= deadline {
                    return false;
                }
                self.tries.lock().unwrap()[send] += 1;
                let began = Instant::now();
                let answer = client
                    .post(url)
                    .header("content-type", "application/json")
                    .header("x-signature", &signature)
                    .body(body.clone())
                    .timeout(Duration::from_secs(10))
                    .send()
                    .await;
                let (taken, name) = match answer {
                    Ok(response) if response.status().is_success() => {
                        let status = response.status().as_u16();
                        let text = response.text().await.unwrap_or_default();
                        let status_field = answer_status(&text);
                        if status_field == "accepted" {
                            self.accepted.lock().unwrap()[index as usize] += 1;
                        }
                        (true, format!("{status} {status_field}"))
                    }
                    Ok(response) => (false, response.status().as_u16().to_string()),
                    Err(_) => (false, "no answer".to_owned()),
                };
                let answered = Instant::now();
                if name != "no answer" {
                    self.latencies.lock().unwrap().push(answered - began);
                }
                *self.answers.lock().unwrap().entry(name).or_default() += 1;
                if taken {
                    self.acknowledged.lock().unwrap()[index as usize] = true;
                    self.first_answered.lock().unwrap()[index as usize].get_or_insert(answered);
                    self.answered.lock().unwrap().push(answered);
                    self.acks.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                // A sender backs off before trying again; the server may be starting.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

async fn send_while_killing(
    events: usize,
    kills: usize,
    deadline: Instant,
    rng: &mut Rng,
    server: &mut Server,
) -> Result<Sent, String> {
    let mut plan: Vec<u32> = (0..events as u32).chain(0..events as u32 / 10).collect();
    rng.shuffle(&mut plan);
    let sends = plan.len();
    server.start().await?;
    let state = Senders::new(plan, events, vec![server.hooks_url("demo")], None);
    let senders = state.spawn(SENDERS, deadline);

    let mut points: Vec<usize> = (0..kills)
        .map(|_| sends / 20 + rng.below(sends as u64 * 16 / 20) as usize)
        .collect();
    points.sort_unstable();
    let mut killed_at = Vec::new();
    let mut at_failpoint = 0;
    for (n, point) in points.into_iter().enumerate() {
        if server.armed() {
            // Killed as soon as it stops: its sender is still waiting for the answer.
            server.reach_failpoint().await?;
            at_failpoint += 1;
        } else {
            while state.acks.load(Ordering::Relaxed) < point && Instant::now() < deadline {
                server.failed()?;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            if Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(rng.below(10))).await;
        }
        killed_at.push(server.kill().await?);
        // Started again at once, not waited for: the senders retry until it answers. The
        // server before every fourth kill is armed to stop at its failpoint.
        server.spawn(n % 4 == 2)?;
    }
    Ok(Sent {
        again: (events / 10) as u64,
        killed_at,
        at_failpoint,
        ..state.finish(senders).await?
    })
}

/// Waits until every acknowledged event has reached the receiver and the server's outbox
/// holds no row unsent (a row a killed server sent without marking it is sent again when
/// its lease ends), and no request came for a moment after that. False if the deadline came
/// first, or if the outbox has nothing left to send and no request has come for
/// [`STALLED`] while acknowledged events are still missing: the server never stored them.
async fn reached<DB: TestBackend>(
    sinks: &[&Sink],
    store: &sqlx::Pool<DB>,
    acknowledged: &[bool],
    deadline: Instant,
) -> bool {
    let unsent = format!(
        "SELECT {} FROM justonce_outbox WHERE sent_at IS NULL",
        DB::quoted("key")
    );
    let mut quiet = None;
    let requests = || sinks.iter().map(|sink| sink.requests()).sum::<usize>();
    let mut last_request = (Instant::now(), requests());
    while Instant::now() < deadline {
        // The outbox first: a row is marked sent only after the receiver has it, so what is
        // read from the receiver after includes every row found sent.
        let all_sent = DB::texts(store, unsent.clone())
            .await
            .is_ok_and(|keys| keys.is_empty());
        let requests = requests();
        if requests != last_request.1 {
            last_request = (Instant::now(), requests);
        }
        let mut arrived = vec![false; acknowledged.len()];
        for request in sinks.iter().flat_map(|sink| sink.received()) {
            if let Some(got) =
                workload_index(&request.body).and_then(|index| arrived.get_mut(index as usize))
            {
                *got = true;
            }
        }
        let all_arrived = acknowledged
            .iter()
            .zip(&arrived)
            .all(|(ack, got)| !ack || *got);
        if all_sent && !all_arrived && last_request.0.elapsed() >= STALLED {
            return false;
        }
        if all_arrived && all_sent {
            let (since, seen) = *quiet.get_or_insert((Instant::now(), requests));
            if seen != requests {
                quiet = None;
            } else if since.elapsed() >= Duration::from_millis(500) {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// The `status` field of the server's JSON answer (`accepted`, `duplicate`).
fn answer_status(text: &str) -> &str {
    text.split("\"status\":\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap_or("")
}

/// A `[sources.NAME]` table: signed webhooks (hmac-sha256) with the id in the body,
/// forwarded to `target`, with `settings` added.
pub fn source(name: &str, target: &str, settings: &str) -> String {
    format!(
        r#"
[sources.{name}]
scheme = "hmac-sha256"
secrets = ["env:HARNESS_SECRET"]
id = "json:/id"
target = "{target}"
{settings}
"#
    )
}

/// The source's signature of `body`: hex HMAC-SHA256 with a `sha256=` prefix.
fn signature(body: &[u8]) -> String {
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(SECRET.as_bytes()).expect("any key");
    mac.update(body);
    let hex: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect();
    format!("sha256={hex}")
}

/// `justonce serve` with one source forwarding to the receiver, or the deliberately broken
/// `answer-first-server` with the same source.
pub struct Server {
    config: PathBuf,
    pub public: String,
    /// `answer-first-server`'s arguments, when it runs instead of `justonce serve`.
    answer_first: Option<[String; 3]>,
    running: Option<Child>,
    /// The armed server's output, where it says it reached the failpoint.
    paused: Option<Lines<BufReader<ChildStdout>>>,
    /// The relay's log lines, when they are watched.
    relay_log: Option<Arc<Mutex<Vec<String>>>>,
}

impl Server {
    fn configure(database: &str, target: &str, answer_first: bool) -> Result<Self, String> {
        let mut server = Self::with_settings(
            database,
            r#"# Deliveries a killed server had in flight go again when their lease ends.
relay_lease = "2s""#,
            &source("demo", target, ""),
        )?;
        server.answer_first = answer_first.then(|| {
            [
                database.to_owned(),
                server.public.trim_start_matches("http://").to_owned(),
                target.to_owned(),
            ]
        });
        Ok(server)
    }

    /// `justonce serve` on free loopback ports with `server` added to its `[server]` table,
    /// and `sources`.
    pub fn with_settings(database: &str, server: &str, sources: &str) -> Result<Self, String> {
        let (public, admin) = (free_port()?, free_port()?);
        let config = std::env::temp_dir().join(format!("justonce-harness-{public}.toml"));
        std::fs::write(
            &config,
            format!(
                r#"[server]
listen = "127.0.0.1:{public}"
admin_listen = "127.0.0.1:{admin}"
database = "{database}"
{server}
{sources}"#
            ),
        )
        .map_err(|e| format!("cannot write {}: {e}", config.display()))?;
        Ok(Self {
            config,
            public: format!("http://127.0.0.1:{public}"),
            answer_first: None,
            running: None,
            paused: None,
            relay_log: None,
        })
    }

    /// Keeps the relay's log lines from the next start on, for [`Server::relay_log`]; the
    /// server's other lines go to standard error as they come.
    pub fn watch_relay(&mut self) {
        self.relay_log = Some(Arc::default());
    }

    /// The relay's log lines so far.
    pub fn relay_log(&self) -> Vec<String> {
        self.relay_log
            .as_ref()
            .map(|log| log.lock().unwrap().clone())
            .unwrap_or_default()
    }

    /// Where `source`'s webhooks are posted.
    pub fn hooks_url(&self, source: &str) -> String {
        format!("{}/webhooks/{source}", self.public)
    }

    /// The server's name in messages.
    fn name(&self) -> &'static str {
        match self.answer_first {
            Some(_) => "answer-first-server",
            None => "justonce serve",
        }
    }

    fn built_by(&self) -> &'static str {
        match self.answer_first {
            Some(_) => "cargo build -p justonce-tests",
            None => "cargo build -p justonce-cli --features failpoints",
        }
    }

    /// Starts the server; `armed`, it stops at its failpoint. The deliberately broken server
    /// has none: it is never armed.
    fn spawn(&mut self, armed: bool) -> Result<(), String> {
        let armed = armed && self.answer_first.is_none();
        let mut command = match &self.answer_first {
            Some(args) => {
                let mut command = Command::new(sibling("answer-first-server"));
                command.args(args);
                command
            }
            None => {
                let mut command = Command::new(sibling("justonce"));
                command.arg("--config").arg(&self.config).arg("serve");
                if armed {
                    command.env("JUSTONCE_FAILPOINT", FAILPOINT);
                }
                command
            }
        };
        if self.relay_log.is_some() {
            command
                .env("RUST_LOG", format!("error,{RELAY_LOG}=info"))
                .stderr(Stdio::piped());
        } else {
            command.env("RUST_LOG", "error");
        }
        let mut child = command
            .env("HARNESS_SECRET", SECRET)
            .stdout(if armed { Stdio::piped() } else { Stdio::null() })
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                format!(
                    "cannot start {} (built by {}): {e}",
                    self.name(),
                    self.built_by()
                )
            })?;
        self.paused = child
            .stdout
            .take()
            .map(|stdout| BufReader::new(stdout).lines());
        if let (Some(log), Some(stderr)) = (&self.relay_log, child.stderr.take()) {
            let log = Arc::clone(log);
            tokio::spawn(async move {
                let mut lines = BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if line.contains(RELAY_LOG) {
                        log.lock().unwrap().push(line);
                    } else {
                        eprintln!("{line}");
                    }
                }
            });
        }
        self.running = Some(child);
        Ok(())
    }

    fn armed(&self) -> bool {
        self.paused.is_some()
    }

    /// Waits until the armed server says it stopped at its failpoint.
    async fn reach_failpoint(&mut self) -> Result<(), String> {
        let (name, built_by) = (self.name(), self.built_by());
        let lines = self.paused.as_mut().ok_or("the server is not armed")?;
        let wanted = format!("paused {FAILPOINT}");
        let reached = async {
            while let Some(line) = lines.next_line().await.map_err(|e| e.to_string())? {
                if line == wanted {
                    return Ok(());
                }
            }
            Err(format!("{name} exited before its failpoint"))
        };
        tokio::time::timeout(Duration::from_secs(60), reached)
            .await
            .map_err(|_| {
                format!(
                    "{name} did not reach its failpoint {FAILPOINT} in 60 s (built by {built_by}?)"
                )
            })?
    }

    /// Starts the server and waits until it answers.
    pub async fn start(&mut self) -> Result<(), String> {
        self.spawn(false)?;
        let client = reqwest::Client::new();
        let health = format!("{}/healthz", self.public);
        for _ in 0..400 {
            self.failed()?;
            if client
                .get(&health)
                .send()
                .await
                .is_ok_and(|answer| answer.status().is_success())
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        Err(format!("{} did not answer in 10 s", self.name()))
    }

    /// SIGKILLs the server; when the kill was sent, and when the process was gone.
    async fn kill(&mut self) -> Result<(Instant, Instant), String> {
        let began = Instant::now();
        self.paused = None;
        if let Some(mut child) = self.running.take() {
            child
                .kill()
                .await
                .map_err(|e| format!("cannot kill the server: {e}"))?;
        }
        Ok((began, Instant::now()))
    }

    /// An error if the server exited on its own: it failed.
    fn failed(&mut self) -> Result<(), String> {
        if let Some(child) = &mut self.running
            && let Some(status) = child.try_wait().map_err(|e| e.to_string())?
        {
            return Err(format!("{} exited on its own: {status}", self.name()));
        }
        Ok(())
    }

    /// Stops the server with SIGTERM, which lets the relay finish its round, once it has
    /// had time to deliver what it accepted.
    pub async fn stop(&mut self) -> Result<(), String> {
        if self.armed() {
            // Its stopped request would hold up a graceful shutdown for good.
            return self.kill().await.map(|_| ());
        }
        let Some(child) = self.running.take() else {
            return Ok(());
        };
        let pid = child.id().ok_or("the server's process id")?.to_string();
        let status = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("kill -TERM {pid}: {status}"));
        }
        let output = tokio::time::timeout(Duration::from_secs(40), child.wait_with_output())
            .await
            .map_err(|_| format!("{} did not stop on SIGTERM", self.name()))?
            .map_err(|e| e.to_string())?;
        if !output.status.success() {
            return Err(format!("{} exited with {}", self.name(), output.status));
        }
        Ok(())
    }
}

fn free_port() -> Result<u16, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(listener.local_addr().map_err(|e| e.to_string())?.port())
}
