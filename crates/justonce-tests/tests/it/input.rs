//! Invalid keys and consumer names are refused with typed errors before anything is written.

use super::on_every_database;
use justonce_sql::{Consumer, ErrorKind, Key, Scope};
use justonce_tests::{TestBackend, TestDb};

on_every_database!(invalid_input_is_refused_and_writes_nothing);

async fn invalid_input_is_refused_and_writes_nothing<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let long = "k".repeat(256);
    for raw in [
        "",
        "nul\0byte",
        "new\nline",
        "tab\t",
        "\u{1b}[31m",
        long.as_str(),
    ] {
        assert_eq!(
            Key::new(raw).unwrap_err().kind(),
            ErrorKind::InvalidKey,
            "{raw:?}"
        );
    }
    assert_eq!(
        Key::purpose(["invoice", "2026:10"]).unwrap_err().kind(),
        ErrorKind::InvalidKey
    );
    let long = "c".repeat(129);
    for raw in ["", "bill\0ing", long.as_str()] {
        assert_eq!(
            Consumer::new(raw).unwrap_err().kind(),
            ErrorKind::InvalidConsumer,
            "{raw:?}"
        );
    }
    assert_eq!(
        Scope::new("t\0").unwrap_err().kind(),
        ErrorKind::InvalidScope
    );
    assert_eq!((db.rows("keys").await, db.rows("effects").await), (0, 0));
    db.cleanup().await;
}
