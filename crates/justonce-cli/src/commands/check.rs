//! `justonce check`: the configuration and its surroundings, or with a target or a job, the
//! conformance kit.

use super::output::counted;
use crate::check;
use crate::cli::{CheckArgs, Subject};
use crate::config::{BrokerOptions, ConsumerSettings, Settings};
use anyhow::Result;
use justonce_cli_support::Usage;
use justonce_sql::{Backend, Inbox};
use std::collections::{BTreeMap, BTreeSet};
use std::hash::{BuildHasher, RandomState};
use std::time::Instant;

/// `justonce check` alone: says that the configuration and the database are fine, once every
/// target's host resolves and every consumer's broker answers. Warns of keys a source or
/// consumer holds in a scope its configuration no longer gives it.
pub async fn environment<DB: Backend>(settings: &Settings, inbox: &Inbox<DB>) -> Result<()> {
    let brokers = check_environment(settings).await?;
    let counts = inbox.key_counts().await?;
    let held = counts.iter().map(|count| {
        let keys = u64::try_from(count.keys).unwrap_or(0);
        (count.consumer.as_str(), count.scope.as_str(), keys)
    });
    for warning in scope_warnings(&settings.scopes(), held) {
        eprintln!("warning: {warning}");
    }
    println!(
        "configuration and database are fine: {}, {}, {}",
        counted(settings.sources.len(), "source", "sources"),
        counted(settings.consumers.len(), "consumer", "consumers"),
        counted(brokers, "broker reached", "brokers reached")
    );
    Ok(())
}

/// A warning for each scope a configured source or consumer holds keys in that its
/// configuration no longer gives it, from `held`: (name, scope, keys). A message claimed
/// there and sent again is claimed anew in another scope, and acts again.
fn scope_warnings<'a>(
    scopes: &BTreeMap<&str, BTreeSet<String>>,
    held: impl IntoIterator<Item = (&'a str, &'a str, u64)>,
) -> Vec<String> {
    let shown = |scope: &str| match scope {
        "" => "no tenant".to_owned(),
        tenant => format!("tenant {tenant}"),
    };
    held.into_iter()
        .filter(|(_, _, keys)| *keys > 0)
        .filter_map(|(name, scope, keys)| {
            let given = scopes.get(name)?;
            if given.contains(scope) {
                return None;
            }
            let given: Vec<String> = given.iter().map(|scope| shown(scope)).collect();
            Some(format!(
                "{name} holds {} under {}, which its configuration no longer gives it (it \
                 gives {}): a message claimed there and sent again is claimed anew and acts \
                 again, until those keys are purged",
                counted(keys, "key", "keys"),
                shown(scope),
                given.join(", ")
            ))
        })
        .collect()
}

/// Resolves every source's and consumer's target host and probes every consumer's broker,
/// all at once, and names each that fails: one line each. A broker that refuses a consumer's
/// settings (its TLS handshake, its URL) is bad configuration, exit code 2, as it is for
/// `serve`; anything else that fails is a failure. Returns how many brokers it reached: the
/// consumers' distinct URLs.
async fn check_environment(settings: &Settings) -> Result<usize> {
    let targets = settings
        .sources
        .iter()
        .map(|source| ("source", &source.name, &source.destination))
        .chain(
            settings
                .consumers
                .iter()
                .map(|consumer| ("consumer", &consumer.name, &consumer.destination)),
        );
    let targets =
        futures_util::future::join_all(targets.map(|(kind, name, destination)| async move {
            let error = destination.resolve().await.err()?;
            Some((false, format!("{kind} {name}: {error}")))
        }));
    let brokers = futures_util::future::join_all(settings.consumers.iter().map(|consumer| async {
        let error = probe_broker(consumer).await.err()?;
        let misconfigured = matches!(
            error,
            justonce_transport::Error::Tls(_) | justonce_transport::Error::Config(_)
        );
        let problem = format!(
            "consumer {}: {}: {}",
            consumer.name,
            crate::config::redacted(&consumer.from),
            broker_problem(&consumer.name, &error)
        );
        Some((misconfigured, problem))
    }));
    let (targets, brokers) = tokio::join!(targets, brokers);
    let problems: Vec<(bool, String)> = targets.into_iter().chain(brokers).flatten().collect();
    if !problems.is_empty() {
        let lines: Vec<&str> = problems.iter().map(|(_, line)| line.as_str()).collect();
        let report = lines.join("\n");
        return Err(
            if problems.iter().any(|(misconfigured, _)| *misconfigured) {
                Usage(report).into()
            } else {
                anyhow::anyhow!(report)
            },
        );
    }
    let brokers: std::collections::BTreeSet<&str> =
        settings.consumers.iter().map(|c| c.from.as_str()).collect();
    Ok(brokers.len())
}

/// Connects to the consumer's broker with its settings and disconnects, within a few
/// seconds: see each broker's `probe`.
async fn probe_broker(consumer: &ConsumerSettings) -> Result<(), justonce_transport::Error> {
    let url = consumer.from.as_str();
    match &consumer.options {
        BrokerOptions::Amqp(options) => justonce_transport::amqp::probe(url, options).await,
        BrokerOptions::Nats(options) => justonce_transport::nats::probe(url, options).await,
        BrokerOptions::Redis(options) => {
            justonce_transport::redis_streams::probe(url, options).await
        }
        BrokerOptions::Mqtt(options) => justonce_transport::mqtt::probe(url, options).await,
        BrokerOptions::Kafka(options) => justonce_transport::kafka::probe(url, options).await,
    }
}

/// Why a consumer's broker failed its probe, in words; a refused TLS handshake with the
/// setting to look at.
fn broker_problem(name: &str, error: &justonce_transport::Error) -> String {
    match error {
        justonce_transport::Error::Tls(tls) => crate::serve::tls_advice(name, tls),
        error => error.to_string(),
    }
}

/// `justonce check` with a target or a job: the conformance kit.
pub async fn conformance(settings: &Settings, args: CheckArgs, subject: Subject) -> Result<()> {
    let effects = match (args.effects, args.count) {
        (Some(sql), None) => check::Effects::Rows(sql),
        (None, Some(sql)) => check::Effects::Count(sql),
        _ => return Err(Usage("the check needs --effects or --count".to_owned()).into()),
    };
    let target = match subject {
        Subject::Target(url) => check::Target::of(&url, args.to.as_deref(), args.sign.as_deref())?,
        Subject::Job(command) => check::Target::Job(command),
    };
    let keys = if args.keys.is_empty() {
        let run = format!("{:08x}", RandomState::new().hash_one(Instant::now()) as u32);
        (1..=args.events)
            .map(|n| format!("check-{run}-{n}"))
            .collect()
    } else {
        let mut seen = std::collections::HashSet::new();
        if let Some(repeated) = args.keys.iter().find(|key| !seen.insert(key.as_str())) {
            return Err(Usage(format!("--keys names {repeated:?} twice")).into());
        }
        args.keys
    };
    check::run(check::Settings {
        target,
        effects,
        database: args.database.unwrap_or_else(|| settings.database.clone()),
        keys,
        body: args.body,
        headers: args.headers,
        between: args.between,
        delay: args.delay,
        wait: args.wait,
        json: args.json,
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys under no tenant while the configuration now sets one, and under a tenant since
    /// taken off the list, are named; keys in a scope still given, and a name the
    /// configuration no longer has, are not.
    #[test]
    fn keys_in_a_scope_no_longer_given_are_named() {
        let scopes = BTreeMap::from([
            (
                "shop",
                BTreeSet::from(["acme".to_owned(), "globex".to_owned()]),
            ),
            ("orders", BTreeSet::from([String::new()])),
        ]);
        let held = [
            ("shop", "", 12),
            ("shop", "acme", 3),
            ("shop", "initech", 1),
            ("orders", "", 5),
            ("gone", "", 7),
        ];
        assert_eq!(
            scope_warnings(&scopes, held),
            [
                "shop holds 12 keys under no tenant, which its configuration no longer gives \
                 it (it gives tenant acme, tenant globex): a message claimed there and sent \
                 again is claimed anew and acts again, until those keys are purged",
                "shop holds 1 key under tenant initech, which its configuration no longer \
                 gives it (it gives tenant acme, tenant globex): a message claimed there and \
                 sent again is claimed anew and acts again, until those keys are purged",
            ]
        );
    }
}
