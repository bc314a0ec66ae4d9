//! The check: the broker's record against the effect rows in the database, and the table
//! (or JSON) it prints.

use crate::broker::{Record, key_index, key_name};
use justonce_tests::Received;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// The effects at an HTTP receiver that acts once per `Idempotency-Key`, from every request
/// it received: each workload key with the number of distinct keys its requests carried (two
/// would be two effects there; a request without a key is one of its own). A request whose
/// body names no workload key is an effect of a key the workload never had, and so is each
/// key other than `expected_key` of the workload key it came with. Also returns the
/// requests repeated beyond one per workload key.
pub fn receiver_effects(
    received: &[Received],
    expected_key: impl Fn(u32) -> String,
) -> (Vec<(String, i64)>, u64) {
    let mut keys_by_index: HashMap<u32, HashSet<String>> = HashMap::new();
    let mut unexpected = HashSet::new();
    let mut unknown_bodies = 0;
    for (n, request) in received.iter().enumerate() {
        let Some(index) = workload_index(&request.body) else {
            unexpected.insert(format!("request {n} with an unknown body"));
            unknown_bodies += 1;
            continue;
        };
        let key = match &request.key {
            Some(key) => key.clone(),
            None => format!("request {n}, without a key"),
        };
        if key != expected_key(index) {
            unexpected.insert(format!("{} keyed {key:?}", key_name(index)));
        }
        keys_by_index.entry(index).or_default().insert(key);
    }
    let repeated = (received.len() - unknown_bodies - keys_by_index.len()) as u64;
    let effects = keys_by_index
        .into_iter()
        .map(|(index, keys)| (key_name(index), keys.len() as i64))
        .chain(unexpected.into_iter().map(|name| (name, 1)))
        .collect();
    (effects, repeated)
}

/// The workload key a request body carries: the key's name, alone or as the `id` of a JSON
/// object.
pub fn workload_index(body: &[u8]) -> Option<u32> {
    let body = std::str::from_utf8(body).ok()?;
    let name = match body.strip_prefix("{\"id\":\"") {
        Some(rest) => rest.split('"').next()?,
        None => body,
    };
    key_index(name)
}

/// The figures of one run.
pub struct Report {
    pub title: String,
    pub keys: usize,
    pub deliveries: usize,
    pub attempted: u64,
    pub acknowledged: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub unexpected: u64,
    /// Deliveries made again; `None` where the broker cannot say.
    pub redeliveries: Option<u64>,
    pub faults: usize,
    pub recovery: Vec<Duration>,
    pub drained: bool,
    /// What the scenario measured besides, in the order it gives them.
    pub details: Vec<(String, u64)>,
    /// Promises other than the check's that the run broke, each said in a sentence.
    pub breaches: Vec<String>,
}

impl Report {
    /// Compares the harness's broker's `record` with `effects`, each effect key with its
    /// number of rows.
    pub fn check(
        title: String,
        deliveries: usize,
        record: &Record,
        effects: Vec<(String, i64)>,
    ) -> Self {
        let acknowledged: Vec<bool> = record.acknowledged.iter().map(Option::is_some).collect();
        let mut report =
            Self::compare(title, deliveries, &record.attempted, &acknowledged, effects);
        report.redeliveries = Some(record.redeliveries);
        report.faults = record.faults;
        report.recovery = record.recovery.clone();
        report.drained = record.drained;
        report.details = [
            ("acknowledged as processed".to_owned(), record.processed),
            ("acknowledged as duplicates".to_owned(), record.duplicates),
        ]
        .into_iter()
        .chain(
            record
                .refusals
                .iter()
                .map(|(reason, count)| (format!("refused ({reason})"), *count)),
        )
        .collect();
        report
    }

    /// Compares which workload keys were attempted and acknowledged with `effects`, each
    /// effect key with its number of rows. Every key of the workload is required, so an
    /// attempted key without an effect is lost, whether or not it was acknowledged. Faults,
    /// recovery and redeliveries are the caller's to fill in.
    pub fn compare(
        title: String,
        deliveries: usize,
        attempted: &[bool],
        acknowledged: &[bool],
        effects: Vec<(String, i64)>,
    ) -> Self {
        let keys = attempted.len();
        let mut effects: HashMap<String, i64> = effects.into_iter().collect();
        let mut report = Self {
            title,
            keys,
            deliveries,
            attempted: 0,
            acknowledged: 0,
            lost: 0,
            duplicated: 0,
            unexpected: 0,
            redeliveries: None,
            faults: 0,
            recovery: Vec::new(),
            drained: true,
            details: Vec::new(),
            breaches: Vec::new(),
        };
        for index in 0..keys {
            let rows = effects.remove(&key_name(index as u32)).unwrap_or(0);
            report.attempted += u64::from(attempted[index]);
            report.acknowledged += u64::from(acknowledged[index]);
            report.lost += u64::from(attempted[index] && rows == 0);
            report.duplicated += u64::from(rows > 1);
        }
        // What remains are effects of keys the workload never had.
        report.unexpected = effects.len() as u64;
        report.duplicated += effects.values().filter(|rows| **rows > 1).count() as u64;
        report
    }

    /// Whether the run broke a promise: lost, duplicated or unexpected is not 0, or a
    /// scenario's own promise was broken.
    pub fn violated(&self) -> bool {
        self.lost + self.duplicated + self.unexpected > 0 || !self.breaches.is_empty()
    }

    fn fraction(&self, count: u64) -> f64 {
        count as f64 / (self.attempted.max(1)) as f64
    }

    fn recovery_ms(&self) -> Option<(u128, u128)> {
        let mut sorted = self.recovery.clone();
        sorted.sort_unstable();
        let p50 = sorted.get(sorted.len().saturating_sub(1) / 2)?;
        Some((p50.as_millis(), sorted.last()?.as_millis()))
    }

    pub fn table(&self) -> String {
        let mut out = format!(
            "{}\n{} keys, {} deliveries, {} faults{}\n",
            self.title,
            self.keys,
            self.deliveries,
            self.faults,
            if self.drained {
                ""
            } else {
                ", NOT DRAINED before the deadline"
            }
        );
        out += "                  count  fraction\n";
        for (name, count) in [
            ("attempted", self.attempted),
            ("acknowledged", self.acknowledged),
            ("lost", self.lost),
            ("duplicated", self.duplicated),
            ("unexpected", self.unexpected),
        ] {
            out += &format!(
                "{name:<14}{count:>9}  {:>7.3}%\n",
                100.0 * self.fraction(count)
            );
        }
        out += &match self.redeliveries {
            Some(count) => format!("{:<14}{count:>9}\n", "redeliveries"),
            None => format!("{:<14}{:>9}\n", "redeliveries", "n/a"),
        };
        out += &match self.recovery_ms() {
            Some((p50, max)) => format!("recovery      p50 {p50} ms, max {max} ms\n"),
            None => "recovery      - (no fault)\n".to_owned(),
        };
        for (name, count) in &self.details {
            out += &format!("{name}: {count}\n");
        }
        for breach in &self.breaches {
            out += &format!("BROKEN: {breach}\n");
        }
        out
    }

    pub fn json(&self) -> serde_json::Value {
        let mut json = serde_json::json!({
            "title": self.title,
            "keys": self.keys,
            "deliveries": self.deliveries,
            "faults": self.faults,
            "drained": self.drained,
            "breaches": self.breaches,
            "redeliveries": self.redeliveries,
            "recovery_p50_ms": self.recovery_ms().map(|(p50, _)| p50 as u64),
            "recovery_max_ms": self.recovery_ms().map(|(_, max)| max as u64),
            "details": self
                .details
                .iter()
                .map(|(name, count)| (name.clone(), serde_json::Value::from(*count)))
                .collect::<serde_json::Map<_, _>>(),
        });
        for (name, count) in [
            ("attempted", self.attempted),
            ("acknowledged", self.acknowledged),
            ("lost", self.lost),
            ("duplicated", self.duplicated),
            ("unexpected", self.unexpected),
        ] {
            json[name] = count.into();
            json[format!("{name}_fraction")] = self.fraction(count).into();
        }
        json
    }
}

/// The p50, p99 and maximum of `durations` in milliseconds, as details named `what`.
pub fn latency_details(what: &str, durations: &[Duration]) -> Vec<(String, u64)> {
    let mut sorted = durations.to_vec();
    sorted.sort_unstable();
    let at = |fraction: f64| {
        let rank = ((sorted.len() as f64 * fraction).ceil() as usize).max(1);
        sorted.get(rank - 1).map_or(0, |d| d.as_millis() as u64)
    };
    [("p50", at(0.5)), ("p99", at(0.99)), ("max", at(1.0))]
        .into_iter()
        .map(|(name, ms)| (format!("{what} {name} (ms)"), ms))
        .collect()
}
