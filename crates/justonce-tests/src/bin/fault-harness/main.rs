//! The fault harness: runs a scenario against real worker processes and a real database,
//! injects its faults, waits for every delivery to be acknowledged, and checks the
//! database's effect rows against what was attempted and acknowledged.
//!
//! `fault-harness --scenario NAME [--backend postgres|mysql|sqlite]
//! [--broker amqp|redis|nats|mqtt|redis-reader|nats-reader] [--short] [--json]
//! [--broken ack-before-commit|separate-claim|auto-commit|key-per-try|answer-before-store]
//! [--batched] [--seed N]`
//!
//! `--broken` runs a deliberately broken worker instead of the correct one, to prove that
//! the check catches what it is there to catch: such a run must report violations.
//! `--batched` has the consumer of `broker-kill` and `broker-restart` take batches of up to
//! 20 (`broker-worker`'s `run-batched`) instead of one delivery at a time.
//!
//! Prints one table (or one JSON object with `--json`): attempted, acknowledged, lost,
//! duplicated and unexpected keys with their fractions, redeliveries and the recovery time
//! from each fault to the next acknowledged commit. Exits 1 when lost, duplicated or
//! unexpected is not 0, 2 on bad usage.
//!
//! Scenarios:
//! - `kill`: one worker process, four keys at a time, SIGKILLed at random points and,
//!   every fourth time, at its failpoint (a key committed, not yet acknowledged), and
//!   restarted until the workload is drained.
//! - `storm`: 1,000,000 deliveries of 100,000 keys (short: 100,000 of 10,000), each key's
//!   ten deliveries close together, to four worker processes of four lanes each.
//! - `hot-keys`: 64 consumers (four processes of 16 lanes) on 100 keys at a time, every
//!   consumer given every key of a round; 100 rounds of 100 keys (short: 10).
//! - `commit-cut` (PostgreSQL, MariaDB): one worker process of four lanes reaches the database
//!   through a proxy that cuts 300 connections (short: 30) at COMMIT, half after
//!   forwarding it and half before, every sixth opening an outage of 1.5 s: every
//!   connection broken and new ones refused, longer than the worker's three attempts take
//!   to resolve the commit. The details say how each cut was resolved.
//! - `pg-immediate` (PostgreSQL): two worker processes of four lanes on a throwaway cluster
//!   of the harness's own, stopped with `pg_ctl stop -m immediate` 10 times (short: 2)
//!   during the run, down for a second each time, and started again; the workers keep
//!   going.
//! - `broker-kill`: no broker of the harness's own: 20,000 keys, a tenth of them twice
//!   (short: 2,000), published to a queue of the run's own on the real broker of
//!   `--broker` (`amqp`: RabbitMQ, `redis`: a Redis stream read by a consumer group,
//!   `nats`: a JetStream stream read by a durable consumer, `mqtt`: a Mosquitto topic read
//!   on a persistent session, published to gradually, as the consumer advances;
//!   `redis-reader` and `nats-reader`: the same streams read by the single reader, which
//!   keeps its position in the database and acknowledges nothing to the broker), consumed
//!   by one `broker-worker` process, the project's real consumer, SIGKILLed 100 times
//!   (short: 10) at random moments and, every fourth time, at its failpoint (a message's
//!   work committed, the message not yet acknowledged), and restarted, until the broker
//!   holds nothing unacknowledged. Its broken mode is `ack-before-commit`, and for the
//!   single readers `separate-claim` (each entry's effect committed unless its key is
//!   claimed, then the key claimed and the position stored in a second transaction).
//! - `broker-restart`: the broker itself fails. A throwaway broker of the harness's own, on
//!   its own ports and in its own temporary folder (`amqp`: a second RabbitMQ node, `nats`:
//!   a NATS server with JetStream, `redis`: a Redis server with `appendfsync always`,
//!   `mqtt`: a Mosquitto with persistence, autosaving on every change), never the
//!   machine's shared one, is SIGKILLed 5 times (short: 2) at random moments and started
//!   again after up to a second, while 10,000 keys, a tenth of them twice (short: 1,000),
//!   are published with confirms (RabbitMQ's publisher confirms, JetStream's acks, XADD's
//!   replies, MQTT's PUBACKs), in chunks kept 300 keys ahead of the effects, each chunk
//!   published again until the broker confirms it, and one `broker-worker` consumes.
//!   Nothing confirmed may be lost and nothing doubled. The consumer exits when its broker
//!   goes away, and the harness starts it again (the details count how often); the recovery
//!   is from the kill to the first effect committed after the broker is back. A consumer
//!   that commits nothing for 30 s after the broker is back hangs: it is killed and
//!   started again, and the run reports a breach. Mosquitto
//!   writes its store at its autosaves, after the PUBACK: a SIGKILL in between loses a
//!   message it acknowledged. So a chunk counts as confirmed by Mosquitto once the same
//!   process saved its store file after the chunk's last PUBACK (each save is a new
//!   file); a chunk not saved within 5 s is published again.
//!   Kafka has no restart: its test broker keeps its data in memory.
//! - `pause`: a consumer pauses. 10,000 keys (short: 1,000) on a queue of the run's own on
//!   the machine's broker, published in a part per pause and one more, each just before
//!   its pause is asked for, and read by two `broker-worker`s; one stops itself with SIGSTOP
//!   10 times (short: 2), each time at its failpoint, holding a delivery it took and has not
//!   run, for three times the broker's wait before it gives an unacknowledged delivery to
//!   another consumer (`nats`: the consumer's `ack_wait`, 2 s; `redis`: the consumer's
//!   `claim_idle`, 0.5 s, after which the other takes the entries over with `XAUTOCLAIM`;
//!   `kafka`: the group's session timeout, 3 s, after which the other member takes the
//!   paused one's partitions at the rebalance, from the offsets stored in the database)
//!   and until the other committed the held key, then is resumed with SIGCONT. What it held
//!   is processed by the other, and its late commits are acknowledged as duplicates: no
//!   effect doubles. RabbitMQ waits
//!   `consumer_timeout` (30 minutes) and Mosquitto for the session's end: each gives a
//!   paused consumer's deliveries to another only once its connection is closed, which
//!   `broker-kill` covers.
//! - `group-kill`: Kafka's consumer group. 10,000 records for 8,000 keys (long: 100,000
//!   for 80,000) on a topic of the run's own with four partitions, read by two
//!   `broker-worker` members of one group. One is SIGKILLed 5 times (long: 20) at random
//!   points while it consumes; the other takes its partitions once the group's session
//!   timeout (3 s) has passed; then the killed one is started again. Recovery is from the
//!   kill to every partition read on; the details give the time from each restart to the
//!   restarted member's first record. Each partition's offset stored in the database must
//!   be its last record's. Its broken mode is `auto-commit`: members that rely on the
//!   broker's auto-committed offsets and keep taken records in memory for the database.
//! - `relay-kill`: 20,000 outbox rows (short: 2,000) delivered by the project's relay, a
//!   `relay-worker` process, to an HTTP receiver inside the harness; the relay SIGKILLed 100
//!   times (short: 10), every fourth time at its failpoint (a row accepted, not yet marked
//!   sent), and started again, until every row is marked sent.
//! - `serve-kill`: 10,000 signed webhooks (short: 1,000), a tenth sent again after their
//!   2xx, posted to `justonce serve` by eight senders that retry until 2xx; the server
//!   SIGKILLed 100 times (short: 10) and started again at once, every fourth time at its
//!   failpoint (an event stored, its answer not yet sent; `justonce` built with
//!   `--features failpoints`); it forwards each event to an HTTP receiver inside the
//!   harness. Its broken mode is `answer-before-store`: an `answer-first-server` instead,
//!   which answers 2xx before it stores the event.
//! - `slow-clients`: 5,000 signed webhooks (short: 500) posted to `justonce serve` over 20 s
//!   (short: 6 s) while 1,000 hostile connections at once (short: 200) send half a
//!   request's headers and then nothing, another opened as each is closed; the server must
//!   close each within its header timeout (2 s) and forward every event once.
//! - `slow-target`: 2,000 signed webhooks (short: 200) for two sources of `justonce
//!   serve`, one forwarding to a healthy receiver, one to a receiver that does not answer
//!   for 60 s (short: 15 s) and then turns healthy; the healthy one's deliveries must not
//!   wait behind the slow one's, and every event must arrive under one key.
//!
//! Behind an HTTP receiver an effect is a distinct `Idempotency-Key`: a row or an event that
//! arrives with two keys would act twice at a receiver that acts once per key.
//!
//! A run drops its tables and deletes its queue whether it passes, fails its check or
//! fails on the way.

mod broker;
mod broker_faults;
mod kafka_group;
mod proxy;
mod real_broker;
mod relay_kill;
mod report;
mod serve_kill;
mod slow_clients;
mod slow_target;

use broker::{Faults, Workers};
use justonce_tests::{BACKENDS, TestBackend, TestDb};
use report::Report;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

const SCENARIOS: [&str; 13] = [
    "kill",
    "storm",
    "hot-keys",
    "commit-cut",
    "pg-immediate",
    "broker-kill",
    "broker-restart",
    "pause",
    "group-kill",
    "relay-kill",
    "serve-kill",
    "slow-clients",
    "slow-target",
];

/// The deliberately broken modes `--broken` takes; each scenario takes some of them.
const BROKEN_MODES: [&str; 5] = [
    "ack-before-commit",
    "separate-claim",
    "auto-commit",
    "key-per-try",
    "answer-before-store",
];

struct Args {
    scenario: String,
    backend: String,
    /// The real broker of `broker-kill`.
    broker: String,
    short: bool,
    json: bool,
    seed: u64,
    /// The worker's mode: `correct`, or a deliberately broken one.
    mode: String,
    /// Whether a correct broker consumer takes batches.
    batched: bool,
}

impl Args {
    fn parse() -> Option<Self> {
        let mut args = Self {
            scenario: String::new(),
            backend: "postgres".to_owned(),
            broker: "amqp".to_owned(),
            short: false,
            json: false,
            seed: Rng::clock_seed(),
            mode: "correct".to_owned(),
            batched: false,
        };
        let mut raw = std::env::args().skip(1);
        while let Some(flag) = raw.next() {
            match flag.as_str() {
                "--scenario" => {
                    args.scenario = raw.next().filter(|s| SCENARIOS.contains(&s.as_str()))?
                }
                "--backend" => {
                    args.backend = raw.next().filter(|b| BACKENDS.contains(&b.as_str()))?
                }
                "--broker" => {
                    args.broker = raw
                        .next()
                        .filter(|b| real_broker::BROKERS.contains(&b.as_str()))?
                }
                "--short" => args.short = true,
                "--json" => args.json = true,
                "--broken" => {
                    args.mode = raw.next().filter(|m| BROKEN_MODES.contains(&m.as_str()))?
                }
                "--batched" => args.batched = true,
                "--seed" => args.seed = raw.next()?.parse().ok().filter(|s| *s != 0)?,
                _ => return None,
            }
        }
        (!args.scenario.is_empty()).then_some(args)
    }

    /// `broker-worker`'s mode for a correct consumer: one delivery at a time, or batches.
    fn run_mode(&self) -> &'static str {
        if self.batched { "run-batched" } else { "run" }
    }

    /// The short size in CI, the long one otherwise.
    fn size(&self, short: usize, long: usize) -> usize {
        if self.short { short } else { long }
    }
}

/// A small deterministic generator: a run is repeated by its seed.
pub struct Rng(u64);

impl Rng {
    fn clock_seed() -> u64 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("a clock after 1970")
            .as_nanos();
        (nanos as u64) | 1
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i as u64 + 1) as usize);
        }
    }

    /// A number below `bound` (at least 1).
    pub fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % bound.max(1)
    }
}

/// What a scenario runs: the workload, the workers and the faults.
struct Scenario {
    keys: usize,
    /// Workload key indices in delivery order; a key may come more than once.
    plan: Vec<u32>,
    workers: Workers,
    faults: Faults,
    deadline: Duration,
    /// The proxy of `commit-cut`, asked afterwards what it cut.
    proxy: Option<proxy::Proxy>,
    /// The restarts of `pg-immediate`, awaited before the check.
    injector: Option<tokio::task::JoinHandle<Result<(), String>>>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let Some(args) = Args::parse() else {
        eprintln!(
            "usage: fault-harness --scenario {} [--backend postgres|mysql|sqlite] [--broker {}] [--short] [--json] [--broken {}] [--batched] [--seed N]",
            SCENARIOS.join("|"),
            real_broker::BROKERS.join("|"),
            BROKEN_MODES.join("|")
        );
        return ExitCode::from(2);
    };
    let url = match args.backend.as_str() {
        "postgres" => justonce_tests::postgres_url(),
        "mysql" => justonce_tests::mysql_url(),
        _ => format!(
            "sqlite://{}",
            std::env::temp_dir()
                .join(format!("justonce-harness-{}.db", justonce_tests::unique()))
                .display()
        ),
    };
    let result =
        justonce_tests::with_backend!(url, DB => interruptible(run::<DB>(&args, &url)).await);
    match result {
        Ok(report) => {
            if args.json {
                println!("{}", report.json());
            } else {
                print!("{}", report.table());
            }
            if report.violated() {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(error) => {
            eprintln!("fault-harness: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Runs `run` until it ends or the harness is interrupted (SIGINT or SIGTERM). Then the
/// run is dropped, and the processes and brokers it started are killed with it: a broker
/// of the harness's own must not outlive it.
async fn interruptible(
    run: impl std::future::Future<Output = Result<Report, String>>,
) -> Result<Report, String> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt()).map_err(|e| e.to_string())?;
    let mut terminate = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
    tokio::select! {
        report = run => report,
        _ = interrupt.recv() => Err("interrupted: the processes it started are stopped".to_owned()),
        _ = terminate.recv() => Err("terminated: the processes it started are stopped".to_owned()),
    }
}

async fn run<DB: TestBackend>(args: &Args, url: &str) -> Result<Report, String> {
    let mut rng = Rng(args.seed);
    if args.scenario == "pg-immediate" && args.backend != "postgres" {
        return Err("pg-immediate runs on PostgreSQL only: --backend postgres".to_owned());
    }
    if args.scenario == "commit-cut" && args.backend == "sqlite" {
        return Err("commit-cut needs a database server: --backend postgres or mysql".to_owned());
    }
    let broken_modes: &[&str] = match args.scenario.as_str() {
        "relay-kill" => &["key-per-try"],
        "serve-kill" => &["answer-before-store"],
        "group-kill" => &["auto-commit"],
        "slow-clients" | "slow-target" | "broker-restart" | "pause" => &[],
        _ => &["ack-before-commit", "separate-claim"],
    };
    if args.mode != "correct" && !broken_modes.contains(&args.mode.as_str()) {
        return Err(format!(
            "{} has no deliberately broken mode {}",
            args.scenario, args.mode
        ));
    }
    if args.batched
        && (args.mode != "correct"
            || !["broker-kill", "broker-restart"].contains(&args.scenario.as_str()))
    {
        return Err(
            "--batched is for the correct consumer of broker-kill and broker-restart".to_owned(),
        );
    }
    // A consumer acknowledges to the broker, a single reader stores its position with its
    // work: each has the broken order that fits it.
    let broken_for_broker = if args.broker.ends_with("-reader") {
        "separate-claim"
    } else {
        "ack-before-commit"
    };
    if args.scenario == "broker-kill"
        && !["correct", broken_for_broker].contains(&args.mode.as_str())
    {
        return Err(format!(
            "broker-kill's only broken mode for --broker {} is {broken_for_broker}",
            args.broker
        ));
    }
    let cluster = if args.scenario == "pg-immediate" {
        let started = tokio::task::spawn_blocking(justonce_tests::cluster::Cluster::start).await;
        Some(Arc::new(started.map_err(|e| e.to_string())??))
    } else {
        None
    };
    let url = cluster
        .as_ref()
        .map_or(url.to_owned(), |cluster| cluster.url());
    let db = TestDb::<DB>::at(&url).await;
    let title = format!(
        "fault-harness: {}{}{} on {} ({}), seed {}",
        args.scenario,
        if ["broker-kill", "broker-restart", "pause"].contains(&args.scenario.as_str()) {
            format!(
                " through {}{}",
                args.broker,
                if args.batched { " in batches" } else { "" }
            )
        } else if args.scenario == "group-kill" {
            " through kafka".to_owned()
        } else {
            String::new()
        },
        if args.mode == "correct" {
            String::new()
        } else {
            format!(" with the deliberately broken {}", args.mode)
        },
        args.backend,
        if args.short { "short" } else { "long" },
        args.seed
    );
    let started = std::time::Instant::now();
    let result = match args.scenario.as_str() {
        "broker-kill" => real_broker::broker_kill(args, &db, &mut rng, title).await,
        "broker-restart" => broker_faults::broker_restart(args, &db, &mut rng, title).await,
        "pause" => broker_faults::pause(args, &db, &mut rng, title).await,
        "group-kill" => kafka_group::group_kill(args, &db, &mut rng, title).await,
        "relay-kill" => relay_kill::relay_kill(args, &db, &mut rng, title).await,
        "serve-kill" => serve_kill::serve_kill::<DB>(args, &mut rng, title).await,
        "slow-clients" => slow_clients::slow_clients::<DB>(args, &mut rng, title).await,
        "slow-target" => slow_target::slow_target::<DB>(args, &mut rng, title).await,
        _ => through_own_broker(args, &db, &mut rng, cluster.clone(), title).await,
    };
    // The throwaway cluster takes its tables with it, and may be down after a failure.
    let cleanup = if cluster.is_some() && result.is_err() {
        Ok(())
    } else {
        (db.try_cleanup().await).map_err(|e| format!("cannot drop the run's tables: {e}"))
    };
    let mut report = cleaned_up(result, cleanup)?;
    report.details.push((
        "drained in (ms)".to_owned(),
        started.elapsed().as_millis() as u64,
    ));
    Ok(report)
}

/// `result`, unless `cleanup` after it failed: the run's own error comes first.
fn cleaned_up<T>(result: Result<T, String>, cleanup: Result<(), String>) -> Result<T, String> {
    match (result, cleanup) {
        (result, Ok(())) => result,
        (Ok(_), Err(cleanup)) => Err(cleanup),
        (Err(error), Err(cleanup)) => Err(format!("{error}; then, cleaning up: {cleanup}")),
    }
}

/// A scenario whose deliveries the harness's own broker makes to `harness-worker`s.
async fn through_own_broker<DB: TestBackend>(
    args: &Args,
    db: &TestDb<DB>,
    rng: &mut Rng,
    cluster: Option<Arc<justonce_tests::cluster::Cluster>>,
    title: String,
) -> Result<Report, String> {
    let mut scenario = match args.scenario.as_str() {
        "kill" => kill(args, db, rng),
        "storm" => storm(args, db, rng),
        "hot-keys" => hot_keys(args, db, rng),
        "commit-cut" => commit_cut(args, db, rng).await?,
        _ => pg_immediate(args, db, rng, cluster.expect("started above")),
    };
    let deliveries = scenario.plan.len();
    let record = broker::deliver(
        &scenario.workers,
        scenario.keys,
        std::mem::take(&mut scenario.plan),
        std::mem::replace(&mut scenario.faults, Faults::None),
        rng,
        scenario.deadline,
    )
    .await?;
    if let Some(injector) = scenario.injector.take() {
        injector.await.map_err(|e| e.to_string())??;
    }
    let effects = DB::effect_counts(db.inbox.pool(), &db.prefix)
        .await
        .map_err(|e| format!("cannot read the effect rows: {e}"))?;
    let mut report = Report::check(title, deliveries, &record, effects);
    if args.scenario == "kill" {
        report.details.push((
            format!(
                "kills at the failpoint ({})",
                justonce_tests::WORKER_FAILPOINT
            ),
            record.at_failpoint,
        ));
    }
    if let Some(proxy) = &scenario.proxy {
        report.details.extend(cut_details(&proxy.cuts(), &record));
    }
    Ok(report)
}

/// `processes` worker processes of `lanes` lanes each on `db`'s tables.
fn workers<DB: TestBackend>(
    args: &Args,
    db: &TestDb<DB>,
    processes: usize,
    lanes: usize,
) -> Workers {
    Workers {
        url: db.url.clone(),
        prefix: db.prefix.clone(),
        mode: args.mode.clone(),
        processes,
        lanes,
        // Twice the lanes: a lane never waits for the broker.
        window: 2 * lanes,
        max_attempts: 10,
    }
}

/// One worker process killed at random points and at its failpoint, and restarted, until
/// drained.
fn kill<DB: TestBackend>(args: &Args, db: &TestDb<DB>, rng: &mut Rng) -> Scenario {
    let keys = args.size(5_000, 50_000);
    let mut plan: Vec<u32> = (0..keys as u32).collect();
    rng.shuffle(&mut plan);
    Scenario {
        keys,
        plan,
        workers: workers(args, db, 1, 4),
        faults: Faults::Kills(args.size(20, 200)),
        deadline: Duration::from_secs(args.size(120, 1200) as u64),
        proxy: None,
        injector: None,
    }
}

/// Ten deliveries of every key, shuffled within blocks of 100 keys: the copies of a key
/// arrive close together, at different workers, and race.
fn storm<DB: TestBackend>(args: &Args, db: &TestDb<DB>, rng: &mut Rng) -> Scenario {
    let keys = args.size(10_000, 100_000);
    let mut plan = Vec::with_capacity(keys * 10);
    for block in (0..keys as u32).collect::<Vec<_>>().chunks(100) {
        let start = plan.len();
        for _ in 0..10 {
            plan.extend_from_slice(block);
        }
        rng.shuffle(&mut plan[start..]);
    }
    Scenario {
        keys,
        plan,
        workers: workers(args, db, 4, 4),
        faults: Faults::None,
        deadline: Duration::from_secs(args.size(300, 1800) as u64),
        proxy: None,
        injector: None,
    }
}

/// 64 consumers on 100 keys at a time: every consumer is given every key of a round, in
/// shuffled order, so that each key is claimed by many at once.
fn hot_keys<DB: TestBackend>(args: &Args, db: &TestDb<DB>, rng: &mut Rng) -> Scenario {
    let keys = 100 * args.size(10, 100);
    let mut plan = Vec::with_capacity(keys * 64);
    for round in (0..keys as u32).collect::<Vec<_>>().chunks(100) {
        let start = plan.len();
        for _ in 0..64 {
            plan.extend_from_slice(round);
        }
        rng.shuffle(&mut plan[start..]);
    }
    Scenario {
        keys,
        plan,
        workers: Workers {
            window: 16,
            ..workers(args, db, 4, 16)
        },
        faults: Faults::None,
        deadline: Duration::from_secs(args.size(300, 1800) as u64),
        proxy: None,
        injector: None,
    }
}

/// One worker whose connections to the database server are cut at COMMIT by the harness's
/// proxy.
async fn commit_cut<DB: TestBackend>(
    args: &Args,
    db: &TestDb<DB>,
    rng: &mut Rng,
) -> Result<Scenario, String> {
    let (scheme, rest) = db.url.split_once("://").ok_or("a database URL")?;
    let (user, rest) = rest.rsplit_once('@').unwrap_or(("", rest));
    let (server, database) = rest.split_once('/').unwrap_or((rest, ""));
    let (faults, heard) = tokio::sync::mpsc::unbounded_channel();
    let plan = proxy::Plan {
        cuts: args.size(30, 300),
        one_in: 20,
        outage_every: 6,
        outage: Duration::from_millis(1500),
    };
    let commit = if args.backend == "mysql" {
        proxy::MYSQL_COMMIT
    } else {
        proxy::POSTGRES_COMMIT
    };
    let proxy = proxy::Proxy::start(
        server.to_owned(),
        commit,
        plan,
        Rng(rng.below(u64::MAX) | 1),
        faults,
    )
    .await
    .map_err(|e| format!("cannot start the proxy: {e}"))?;
    let user = if user.is_empty() {
        String::new()
    } else {
        format!("{user}@")
    };
    // The proxy reads the protocol to find the COMMIT: in plain text, never TLS.
    let plain = if args.backend == "mysql" {
        "ssl-mode=DISABLED"
    } else {
        "sslmode=disable"
    };
    let separator = if database.contains('?') { '&' } else { '?' };
    let keys = args.size(3_000, 30_000);
    let mut plan: Vec<u32> = (0..keys as u32).collect();
    rng.shuffle(&mut plan);
    Ok(Scenario {
        keys,
        plan,
        workers: Workers {
            url: format!(
                "{scheme}://{user}127.0.0.1:{}/{database}{separator}{plain}",
                proxy.port
            ),
            // Three attempts resolve a lost answer within about half a second: an outage
            // outlasts them, and the commit is reported unknown.
            max_attempts: 3,
            ..workers(args, db, 1, 4)
        },
        faults: Faults::External {
            heard,
            expected: 0,
            progress: Arc::default(),
        },
        deadline: Duration::from_secs(args.size(180, 1800) as u64),
        proxy: Some(proxy),
        injector: None,
    })
}

/// How the worker resolved each cut, from the first acknowledgement of the cut key and
/// whether it was ever refused as `commit-unknown`.
fn cut_details(cuts: &[proxy::Cut], record: &broker::Record) -> Vec<(String, u64)> {
    use broker::Ack::Processed;
    let mut counts = [0u64; 8];
    for cut in cuts {
        let slot = match cut.key.map(|key| key as usize) {
            None => 7,
            Some(key) => match (cut.forwarded, record.unknown[key], record.acknowledged[key]) {
                (true, false, Some(Processed(1))) => 1,
                (true, true, Some(_)) => 2,
                (false, false, Some(Processed(_))) => 4,
                (false, true, Some(_)) => 5,
                _ => 6,
            },
        };
        counts[slot] += 1;
        counts[if cut.forwarded { 0 } else { 3 }] += 1;
    }
    [
        "cuts after COMMIT was forwarded",
        "  resolved by reading the key: processed, work not run again",
        "  unreachable: CommitUnknown, not acknowledged, redelivered",
        "cuts before COMMIT was forwarded",
        "  rolled back: processed by a later attempt",
        "  unreachable: CommitUnknown, not acknowledged, rolled back, redelivered",
        "cuts resolved otherwise",
        "cuts whose key was not seen",
    ]
    .into_iter()
    .zip(counts)
    .map(|(name, count)| (name.to_owned(), count))
    .collect()
}

/// Two workers on the harness's own cluster, which is stopped at once and started again at
/// random points of the run.
fn pg_immediate<DB: TestBackend>(
    args: &Args,
    db: &TestDb<DB>,
    rng: &mut Rng,
    cluster: Arc<justonce_tests::cluster::Cluster>,
) -> Scenario {
    let keys = args.size(3_000, 30_000);
    let restarts = args.size(2, 10);
    let mut plan: Vec<u32> = (0..keys as u32).collect();
    rng.shuffle(&mut plan);
    // After how many acknowledgements each restart comes.
    let mut points: Vec<usize> = (0..restarts)
        .map(|_| keys / 10 + rng.below(keys as u64 * 8 / 10) as usize)
        .collect();
    points.sort_unstable();
    let progress = Arc::new(AtomicUsize::new(0));
    let (faults, heard) = tokio::sync::mpsc::unbounded_channel();
    let acknowledged = Arc::clone(&progress);
    let injector = tokio::spawn(async move {
        for point in points {
            while acknowledged.load(Ordering::Relaxed) < point {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let began = std::time::Instant::now();
            let down = Arc::clone(&cluster);
            tokio::task::spawn_blocking(move || down.stop_immediately())
                .await
                .map_err(|e| e.to_string())??;
            tokio::time::sleep(Duration::from_secs(1)).await;
            let up = Arc::clone(&cluster);
            tokio::task::spawn_blocking(move || up.start_again())
                .await
                .map_err(|e| e.to_string())??;
            let _ = faults.send((began, std::time::Instant::now()));
        }
        Ok(())
    });
    Scenario {
        keys,
        plan,
        workers: workers(args, db, 2, 4),
        faults: Faults::External {
            heard,
            expected: restarts,
            progress,
        },
        deadline: Duration::from_secs(args.size(180, 1800) as u64),
        proxy: None,
        injector: Some(injector),
    }
}
