//! What the configuration's tests share: the files they start from and loading them.

use super::{Env, Settings, load};
use anyhow::Result;

/// The variables of a test.
pub fn env_of(pairs: &[(&str, &str)]) -> Env {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Loads `text` from a file of its own.
pub fn load_text(text: &str, env: &Env) -> Result<Settings> {
    let path = write_temporary(text);
    let settings = load(&path, None, env);
    let _ = std::fs::remove_file(path);
    settings
}

/// The error loading `text` ends in; a panic if it is accepted.
pub fn error_of(text: &str, env: &Env) -> String {
    match load_text(text, env) {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(error) => format!("{error:#}"),
    }
}

/// `text` in a new file of the temporary folder.
pub fn write_temporary(text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("justonce-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!("{n}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// [`SHOP`] and [`ORDERS`] together.
pub fn shop_and_orders() -> String {
    format!("{SHOP}{ORDERS}")
}

/// Loads `text` and checks that the error names the file, `key` and `expected`.
pub fn assert_named(text: &str, env: &Env, key: &str, expected: &str) {
    let path = write_temporary(text);
    let error = match load(&path, None, env) {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(error) => format!("{error:#}"),
    };
    let _ = std::fs::remove_file(&path);
    for part in [path.display().to_string().as_str(), key, expected] {
        assert!(error.contains(part), "{part:?} not in {error:?}");
    }
    for secret in ["c2VjcmV0", "hunter2"] {
        assert!(!error.contains(secret), "a secret was printed: {error}");
    }
}

/// Loads with no file at all: every setting from `env` and defaults.
pub fn load_without_file(env: &Env) -> Result<Settings> {
    load(
        &std::env::temp_dir().join("justonce-no-such-file.toml"),
        None,
        env,
    )
}

/// A server and a Standard Webhooks source. The lines the tests name: 3 `listen`,
/// 4 `body_limit`, 7 `scheme`, 8 `secrets`, 9 `target`.
pub const SHOP: &str = r#"
[server]
listen = "127.0.0.1:8080"
body_limit = "64KiB"

[sources.shop]
scheme = "standard-webhooks"
secrets = ["env:SHOP_SECRET"]
target = "http://127.0.0.1:9000/hooks/shop"
"#;

/// A RabbitMQ consumer. The lines the tests name, after [`SHOP`]: 12 `from`, 13 `queue`,
/// 15 `max_attempts`, 16 `target`.
pub const ORDERS: &str = r#"
[consumers.orders]
from = "env:ORDERS_BROKER"
queue = "orders"
id = "header:X-Order-Id"
max_attempts = 3
target = "http://127.0.0.1:9000/orders"
"#;
