//! A throwaway MariaDB server of a test's own that takes TLS connections only:
//! `mariadb-install-db` into a temporary folder, its own port and socket, a certificate
//! from the test's CA. The machine's shared server is never touched.

use crate::cluster::run;
use crate::tls::TestCa;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A MariaDB server with `require_secure_transport`, stopped and removed when dropped.
pub struct TlsMariaDb {
    folder: PathBuf,
    port: u16,
    /// The server, once started.
    server: Option<Child>,
}

impl TlsMariaDb {
    /// Creates and starts the server with a certificate from `ca` for `names`, and a user
    /// `test` with every privilege and an empty password, and a database `test`.
    pub fn start(ca: &TestCa, names: &[&str]) -> Result<Self, String> {
        let folder = std::env::temp_dir().join(format!("justonce-mariadb-{}", crate::unique()));
        let data = folder.join("data");
        std::fs::create_dir_all(&data).map_err(|e| format!("{}: {e}", data.display()))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .map_err(|e| format!("no free port: {e}"))?
            .port();
        // Removes the folder if anything below fails.
        let mut started = Self {
            folder,
            port,
            server: None,
        };
        let folder = &started.folder;
        // mariadbd refuses to run as root unless told to.
        let root = std::fs::metadata("/proc/self").is_ok_and(|me| me.uid() == 0);
        let user = root.then_some("--user=root");
        run(Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .args(["--auth-root-authentication-method=socket", "--skip-test-db"])
            .args(user))?;
        let (cert, key) = ca.server(names);
        let socket = folder.join("mariadb.sock");
        let server = Command::new(mariadbd()?)
            .arg("--no-defaults")
            .arg(format!("--datadir={}", data.display()))
            .arg(format!("--socket={}", socket.display()))
            .arg(format!(
                "--pid-file={}",
                folder.join("mariadb.pid").display()
            ))
            .arg(format!(
                "--log-error={}",
                folder.join("error.log").display()
            ))
            .arg(format!("--port={port}"))
            .args([
                "--bind-address=127.0.0.1",
                "--skip-name-resolve",
                "--skip-log-bin",
            ])
            .args(["--innodb-buffer-pool-size=16M", "--innodb-log-file-size=8M"])
            .arg(format!("--ssl-cert={}", cert.display()))
            .arg(format!("--ssl-key={}", key.display()))
            .arg(format!("--ssl-ca={}", ca.ca_file().display()))
            .arg("--require-secure-transport=ON")
            .args(user)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start mariadbd: {e}"))?;
        started.server = Some(server);
        started.await_socket(&socket)?;
        // A socket connection counts as secure: the test's user is made through it.
        run(Command::new("mariadb")
            .arg("--no-defaults")
            .arg(format!("--socket={}", socket.display()))
            .args(["-uroot", "-e"])
            .arg("CREATE USER 'test'@'%'; GRANT ALL ON *.* TO 'test'@'%'; CREATE DATABASE test;"))?;
        Ok(started)
    }

    /// The server's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    fn await_socket(&mut self, socket: &std::path::Path) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            let server = self.server.as_mut().expect("a started server");
            if let Ok(Some(status)) = server.try_wait() {
                let log =
                    std::fs::read_to_string(self.folder.join("error.log")).unwrap_or_default();
                return Err(format!("mariadbd exited with {status}:\n{log}"));
            }
            if std::os::unix::net::UnixStream::connect(socket).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err("mariadbd did not take connections within 60 s".to_owned())
    }
}

impl Drop for TlsMariaDb {
    fn drop(&mut self) {
        if let Some(mut server) = self.server.take() {
            let _ = server.kill();
            let _ = server.wait();
        }
        let _ = std::fs::remove_dir_all(&self.folder);
    }
}

/// The server program: `mariadbd`, or `mysqld` where only that name is installed.
fn mariadbd() -> Result<PathBuf, String> {
    ["/usr/sbin/mariadbd", "/usr/sbin/mysqld"]
        .iter()
        .map(PathBuf::from)
        .find(|program| program.exists())
        .ok_or_else(|| "MariaDB's server program (mariadbd) not found".to_owned())
}
