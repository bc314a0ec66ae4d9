//! The fault harness: runs a scenario against real worker processes and a real database,
//! injects its faults, waits for every delivery to be acknowledged, and checks the
//! database's effect rows against what was attempted and acknowledged.
//!
//! `fault-harness --scenario NAME [--backend postgres|mysql|sqlite] [--short] [--json]
//! [--broken ack-before-commit|separate-claim] [--seed N]`
//!
//! `--broken` runs a deliberately broken worker instead of the correct one, to prove that
//! the check catches what it is there to catch: such a run must report violations.
//!
//! Prints one table (or one JSON object with `--json`): attempted, acknowledged, lost,
//! duplicated and unexpected keys with their fractions, redeliveries and the recovery time
//! from each fault to the next acknowledged commit. Exits 1 when lost, duplicated or
//! unexpected is not 0, 2 on bad usage.
//!
//! Scenarios:
//! - `kill`: one worker process, four keys at a time, SIGKILLed at random points and
//!   restarted until the workload is drained.

mod broker;
mod report;

use broker::{Faults, Workers};
use justonce_tests::{BACKENDS, TestBackend, TestDb};
use report::Report;
use std::process::ExitCode;
use std::time::Duration;

const SCENARIOS: [&str; 1] = ["kill"];

struct Args {
    scenario: String,
    backend: String,
    short: bool,
    json: bool,
    seed: u64,
    /// The worker's mode: `correct`, or a deliberately broken one.
    mode: String,
}

impl Args {
    fn parse() -> Option<Self> {
        let mut args = Self {
            scenario: String::new(),
            backend: "postgres".to_owned(),
            short: false,
            json: false,
            seed: Rng::clock_seed(),
            mode: "correct".to_owned(),
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
                "--short" => args.short = true,
                "--json" => args.json = true,
                "--broken" => {
                    args.mode = raw
                        .next()
                        .filter(|m| ["ack-before-commit", "separate-claim"].contains(&m.as_str()))?
                }
                "--seed" => args.seed = raw.next()?.parse().ok().filter(|s| *s != 0)?,
                _ => return None,
            }
        }
        (!args.scenario.is_empty()).then_some(args)
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
}

#[tokio::main]
async fn main() -> ExitCode {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let Some(args) = Args::parse() else {
        eprintln!(
            "usage: fault-harness --scenario {} [--backend postgres|mysql|sqlite] [--short] [--json] [--broken ack-before-commit|separate-claim] [--seed N]",
            SCENARIOS.join("|")
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
    let result = justonce_tests::with_backend!(url, DB => run::<DB>(&args, &url).await);
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

async fn run<DB: TestBackend>(args: &Args, url: &str) -> Result<Report, String> {
    let mut rng = Rng(args.seed);
    let db = TestDb::<DB>::at(url).await;
    let scenario = kill(args, &db);
    let title = format!(
        "fault-harness: {}{} on {} ({}), seed {}",
        args.scenario,
        if args.mode == "correct" {
            String::new()
        } else {
            format!(" with the deliberately broken {}", args.mode)
        },
        args.backend,
        if args.short { "short" } else { "long" },
        args.seed
    );
    let deliveries = scenario.plan.len();
    let record = broker::deliver(
        &scenario.workers,
        scenario.keys,
        scenario.plan,
        scenario.faults,
        &mut rng,
        scenario.deadline,
    )
    .await?;
    let effects = DB::effect_counts(db.inbox.pool(), &db.prefix)
        .await
        .map_err(|e| format!("cannot read the effect rows: {e}"))?;
    let report = Report::check(title, deliveries, &record, effects);
    db.cleanup().await;
    Ok(report)
}

/// One worker process killed at random points and restarted, until drained.
fn kill<DB: TestBackend>(args: &Args, db: &TestDb<DB>) -> Scenario {
    let keys = args.size(5_000, 50_000);
    Scenario {
        keys,
        plan: (0..keys as u32).collect(),
        workers: Workers {
            url: db.url.clone(),
            prefix: db.prefix.clone(),
            mode: args.mode.clone(),
            processes: 1,
            lanes: 4,
            window: 8,
        },
        faults: Faults::Kills(args.size(20, 200)),
        deadline: Duration::from_secs(args.size(120, 1200) as u64),
    }
}
