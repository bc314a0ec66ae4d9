//! TLS to the database: a throwaway PostgreSQL cluster and a throwaway MariaDB server that
//! take TLS connections only, with certificates from a CA the test makes. `stats` and
//! `serve` work with the right CA and full verification, and stop at start with exit code
//! 2, naming the database and the problem, when the certificate or the URL is wrong.

use crate::serve::{Server, all_delivered, client, post, run_capturing};
use justonce_tests::Sink;
use justonce_tests::cluster::{CERT_USER, Cluster};
use justonce_tests::mariadb::TlsMariaDb;
use justonce_tests::tls::TestCa;
use std::path::Path;
use std::time::Duration;

/// The names the servers' certificates hold: `localhost`, not `127.0.0.1`.
const NAMES: &[&str] = &["localhost"];

fn postgres_url(host: &str, port: u16, tls: &str) -> String {
    format!("postgres://postgres@{host}:{port}/postgres?{tls}")
}

fn mysql_url(host: &str, port: u16, tls: &str) -> String {
    format!("mysql://test@{host}:{port}/test?{tls}")
}

fn ca_parameter(name: &str, ca: &Path) -> String {
    format!("{name}={}", ca.display())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_verified_with_the_test_ca_stores_a_webhook_once_and_delivers_it_once() {
    let ca = TestCa::new();
    let cluster = Cluster::start_tls(&ca, NAMES).expect("a PostgreSQL cluster with TLS");
    let tls = format!(
        "sslmode=verify-full&{}",
        ca_parameter("sslrootcert", &ca.ca_file())
    );
    stored_once_and_delivered_once(&postgres_url("localhost", cluster.port(), &tls)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_verified_with_the_test_ca_stores_a_webhook_once_and_delivers_it_once() {
    let ca = TestCa::new();
    let server = TlsMariaDb::start(&ca, NAMES).expect("a MariaDB server with TLS");
    let tls = format!(
        "ssl-mode=VERIFY_IDENTITY&{}",
        ca_parameter("ssl-ca", &ca.ca_file())
    );
    stored_once_and_delivered_once(&mysql_url("localhost", server.port(), &tls)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_certificate_problems_stop_stats_and_serve_with_exit_2() {
    let ca = TestCa::new();
    let other_ca = TestCa::new();
    let cluster = Cluster::start_tls(&ca, NAMES).expect("a PostgreSQL cluster with TLS");
    let port = cluster.port();
    let verify = |ca: &TestCa| {
        format!(
            "sslmode=verify-full&{}",
            ca_parameter("sslrootcert", &ca.ca_file())
        )
    };
    refused(
        &postgres_url("localhost", port, &verify(&other_ca)),
        "signed by an unknown certificate authority: not the one in sslrootcert",
    )
    .await;
    refused(
        &postgres_url("127.0.0.1", port, &verify(&ca)),
        "the server's certificate does not name the host 127.0.0.1: it names localhost",
    )
    .await;
    refused(
        &postgres_url("localhost", port, "sslmode=disable"),
        "a server that requires TLS does so, and sslmode=disable turns TLS off",
    )
    .await;
    // `check` reads the effects from the user's database under the same rule.
    let wrong_ca = postgres_url("localhost", port, &verify(&other_ca));
    let server = Server::configure(&wrong_ca, "http://127.0.0.1:1/unused");
    let args = [
        "check",
        "--run",
        "true",
        "--count",
        "SELECT 1",
        "--database",
        &wrong_ca,
    ];
    let (code, _, stderr) = run_capturing(&server, &args).await;
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("signed by an unknown certificate authority"),
        "{stderr}"
    );
    // A mode that checks less is spelled out, and said at start.
    let (code, stderr) = stats(&postgres_url(
        "127.0.0.1",
        port,
        &format!(
            "sslmode=verify-ca&{}",
            ca_parameter("sslrootcert", &ca.ca_file())
        ),
    ))
    .await;
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.contains("sslmode=verify-ca does not check the host name"),
        "{stderr}"
    );
}

/// A user that authenticates by client certificate: `stats` works with the certificate
/// and its key, and without them stops at start saying what the server wants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_takes_a_client_certificate_from_the_url() {
    let ca = TestCa::new();
    let cluster = Cluster::start_tls(&ca, NAMES).expect("a PostgreSQL cluster with TLS");
    let verify = format!(
        "sslmode=verify-full&{}",
        ca_parameter("sslrootcert", &ca.ca_file())
    );
    let url = |tls: &str| {
        format!(
            "postgres://{CERT_USER}@localhost:{}/postgres?{tls}",
            cluster.port()
        )
    };
    let (cert, key) = ca.client(CERT_USER);
    let with_certificate = format!(
        "{verify}&{}&{}",
        ca_parameter("sslcert", &cert),
        ca_parameter("sslkey", &key)
    );
    let (code, stderr) = stats(&url(&with_certificate)).await;
    assert_eq!(code, 0, "{stderr}");
    refused(
        &url(&verify),
        "the server requires a client certificate (connection requires a valid client \
         certificate); set sslcert=FILE and sslkey=FILE",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_certificate_problems_stop_stats_and_serve_with_exit_2() {
    let ca = TestCa::new();
    let other_ca = TestCa::new();
    let server = TlsMariaDb::start(&ca, NAMES).expect("a MariaDB server with TLS");
    let port = server.port();
    let verify = |ca: &TestCa| {
        format!(
            "ssl-mode=VERIFY_IDENTITY&{}",
            ca_parameter("ssl-ca", &ca.ca_file())
        )
    };
    refused(
        &mysql_url("localhost", port, &verify(&other_ca)),
        "signed by an unknown certificate authority: not the one in ssl-ca",
    )
    .await;
    refused(
        &mysql_url("127.0.0.1", port, &verify(&ca)),
        "the server's certificate does not name the host 127.0.0.1: it names localhost",
    )
    .await;
    refused(
        &mysql_url("localhost", port, "ssl-mode=DISABLED"),
        "a server that requires TLS does so, and ssl-mode=DISABLED turns TLS off",
    )
    .await;
    let (code, stderr) = stats(&mysql_url("127.0.0.1", port, "ssl-mode=REQUIRED")).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.contains("ssl-mode=REQUIRED does not verify the server's certificate"),
        "{stderr}"
    );
}

/// `migrate`, then `stats`, on `url`: the exit code of the first that fails, or 0, and
/// what they wrote to stderr.
async fn stats(url: &str) -> (i32, String) {
    let server = Server::configure(url, "http://127.0.0.1:1/unused");
    let mut said = String::new();
    for command in ["migrate", "stats"] {
        let (code, _, stderr) = run_capturing(&server, &[command]).await;
        said.push_str(&stderr);
        if code != 0 {
            return (code, said);
        }
    }
    (0, said)
}

/// `stats` and `serve` on `url` both exit 2 at start, naming the database (without its
/// password) and `problem`.
async fn refused(url: &str, problem: &str) {
    let server = Server::configure(url, "http://127.0.0.1:1/unused");
    let database = url.split('?').next().unwrap();
    for command in ["stats", "serve"] {
        let args = [command];
        let (code, _, stderr) =
            tokio::time::timeout(Duration::from_secs(60), run_capturing(&server, &args))
                .await
                .unwrap_or_else(|_| panic!("{command} did not stop at start on {url}"));
        assert_eq!(code, 2, "{command} on {url}: {stderr}");
        assert!(
            stderr.contains(&format!("database {database}?")),
            "{command} does not name the database: {stderr}"
        );
        assert!(
            stderr.contains(problem),
            "{command}: {problem:?} not in {stderr}"
        );
        assert!(
            !stderr.contains("Custom {") && !stderr.contains("InvalidCertificate("),
            "a raw driver error: {stderr}"
        );
    }
}

/// Over `url`, `stats` works and `serve` stores a webhook posted twice once, and delivers
/// it once, as over plain TCP.
async fn stored_once_and_delivered_once(url: &str) {
    let (code, stderr) = stats(url).await;
    assert_eq!(code, 0, "stats over TLS: {stderr}");
    let sink = Sink::start().await;
    let mut server = Server::configure(url, &sink.url());
    server.start().await;
    let client = client();
    let body = r#"{"id":"evt_tls","n":1}"#;
    assert_eq!(
        post(&client, &server.public, body).await.unwrap(),
        (200, "accepted".into())
    );
    assert_eq!(
        post(&client, &server.public, body).await.unwrap(),
        (200, "duplicate".into())
    );
    all_delivered(&server, 1).await;
    let received = sink.received();
    assert_eq!(received.len(), 1, "delivered once");
    assert_eq!(received[0].key.as_deref(), Some("demo:evt_tls"));
    assert_eq!(received[0].body, body.as_bytes());
    server.stop().await;
    let (code, stats, stderr) = run_capturing(&server, &["stats", "--json"]).await;
    assert_eq!(code, 0, "{stderr}");
    let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
    let deliveries = &stats["deliveries"];
    assert_eq!(
        [&deliveries["sent"], &deliveries["due"], &deliveries["dead"]],
        [1, 0, 0],
        "{stats}"
    );
    assert_eq!(stats["keys"][0]["keys"], 1);
}
