//! `justonce.toml` with its `JUSTONCE_*` overrides: whatever the file and the environment,
//! the result is settings that keep the documented rules or an error, never a panic, and an
//! error never repeats a secret read from the environment.
//!
//! The input is the file, then optionally a NUL byte and the environment as `NAME=value`
//! lines, so that a seed is a plain config file.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::collections::BTreeMap;

// The parser lives in the `justonce` binary, which has no library to link against; its
// module depends on nothing else of the binary, so it is compiled into the target.
#[path = "../../crates/justonce-cli/src/config/mod.rs"]
#[allow(dead_code, unused_imports)]
mod config;

/// Where the messages of the parser come from, to tell a secret that happens to spell a
/// word of one from a secret repeated.
const MESSAGES: &str = concat!(
    include_str!("../../crates/justonce-cli/src/config/mod.rs"),
    include_str!("../../crates/justonce-cli/src/config/read/mod.rs"),
    include_str!("../../crates/justonce-cli/src/config/read/env.rs"),
    include_str!("../../crates/justonce-cli/src/config/read/origin.rs"),
    include_str!("../../crates/justonce-cli/src/config/read/raw.rs"),
    include_str!("../../crates/justonce-cli/src/config/validate/consumer.rs"),
    include_str!("../../crates/justonce-cli/src/config/validate/entry.rs"),
    include_str!("../../crates/justonce-cli/src/config/validate/mod.rs"),
    include_str!("../../crates/justonce-cli/src/config/validate/secret.rs"),
    include_str!("../../crates/justonce-cli/src/config/validate/source.rs"),
    include_str!("../../crates/justonce-cli/src/config/validate/tls.rs"),
    include_str!("../../crates/justonce-cli/src/config/validate/traces.rs"),
    include_str!("../../crates/justonce-cli/src/config/validate/units.rs"),
);

fuzz_target!(|data: &[u8]| {
    let (text, env) = match data.iter().position(|&b| b == 0) {
        Some(nul) => (&data[..nul], &data[nul + 1..]),
        None => (data, &[][..]),
    };
    let Ok(text) = std::str::from_utf8(text) else {
        return;
    };
    let env: BTreeMap<String, String> = String::from_utf8_lossy(env)
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .collect();
    match config::parse(text, "justonce.toml", &env) {
        Ok(settings) => {
            assert!(settings.body_limit > 0);
            for source in &settings.sources {
                assert!(!source.name.contains(':') && !source.name.contains('/'));
                assert!(source.retention.keep() >= source.retention.retry_horizon());
            }
            for consumer in &settings.consumers {
                assert!(!consumer.name.contains(':') && !consumer.name.contains('/'));
                assert!(consumer.retention.keep() >= consumer.retention.retry_horizon());
                assert!(settings.sources.iter().all(|s| s.name != consumer.name));
            }
        }
        Err(error) => {
            let message = format!("{error:#}");
            // Variables named by `env:` references are secrets, or broker URLs that may hold
            // a password. Short or blank values are left out: they spell parts of messages.
            for (name, secret) in &env {
                let reference = format!("env:{name}");
                let referenced = !name.is_empty()
                    && (text.contains(&reference) || env.values().any(|v| v.contains(&reference)));
                let plain_text_elsewhere = !referenced
                    || secret.trim().len() < 8
                    || name.starts_with("JUSTONCE_")
                    || text.contains(secret.as_str())
                    || MESSAGES.contains(secret.as_str())
                    || env.iter().any(|(other, value)| {
                        other.starts_with("JUSTONCE_") && value.contains(secret.as_str())
                    });
                assert!(
                    plain_text_elsewhere || !message.contains(secret.as_str()),
                    "the error repeats the value of {name}: {message}"
                );
            }
        }
    }
});
