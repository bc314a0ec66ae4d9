//! A throwaway PostgreSQL cluster of a test's own: `initdb` into a temporary folder, a free
//! port, `pg_ctl` as a non-root user. It is the one stopped with `-m immediate` or killed,
//! and it can have a streaming standby of its own to promote; the machine's shared cluster
//! is never touched.

use crate::tls::TestCa;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The user of a TLS cluster that authenticates by client certificate.
pub const CERT_USER: &str = "cert_user";

/// A PostgreSQL server of its own, stopped and removed when dropped.
pub struct Cluster {
    folder: PathBuf,
    port: u16,
    bin: PathBuf,
    /// The user the server runs as when the test runs as root (PostgreSQL refuses root).
    run_as: Option<&'static str>,
}

impl Cluster {
    /// Creates and starts the cluster.
    pub fn start() -> Result<Self, String> {
        let cluster = Self::create()?;
        cluster.start_again()?;
        Ok(cluster)
    }

    /// Creates and starts a cluster that takes TLS connections only (`hostssl` in
    /// pg_hba.conf), with a certificate from `ca` for `names`. User `postgres` needs no
    /// more; user [`CERT_USER`] must present a client certificate from `ca` in its name.
    pub fn start_tls(ca: &TestCa, names: &[&str]) -> Result<Self, String> {
        let cluster = Self::create()?;
        let data = cluster.folder.join("data");
        let (cert, key) = ca.server(names);
        // PostgreSQL reads its key only from a file of its own user that no one else reads.
        for (from, to) in [
            (cert, "server.crt"),
            (key, "server.key"),
            (ca.ca_file(), "root.crt"),
        ] {
            let copy = data.join(to);
            std::fs::copy(&from, &copy).map_err(|e| format!("{}: {e}", copy.display()))?;
            std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| format!("{}: {e}", copy.display()))?;
            if let Some(user) = cluster.run_as {
                run(Command::new("chown").arg(user).arg(&copy))?;
            }
        }
        append(
            &data.join("postgresql.conf"),
            "ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\nssl_ca_file = 'root.crt'\n",
        )?;
        let hba = data.join("pg_hba.conf");
        std::fs::write(
            &hba,
            format!(
                "local all all trust\n\
                 hostssl all {CERT_USER} 127.0.0.1/32 cert\n\
                 hostssl all postgres 127.0.0.1/32 trust\n\
                 hostssl all postgres ::1/128 trust\n"
            ),
        )
        .map_err(|e| format!("{}: {e}", hba.display()))?;
        cluster.start_again()?;
        let socket = cluster.folder.display().to_string();
        let port = cluster.port.to_string();
        let create = format!("CREATE ROLE {CERT_USER} LOGIN SUPERUSER");
        cluster.pg(
            "psql",
            &["-h", &socket, "-p", &port, "-U", "postgres", "-c", &create],
        )?;
        Ok(cluster)
    }

    /// Creates the cluster, not started.
    fn create() -> Result<Self, String> {
        let cluster = Self::prepare()?;
        let data = cluster.data();
        cluster.pg(
            "initdb",
            &["-D", &data, "-U", "postgres", "--auth=trust", "--no-sync"],
        )?;
        Ok(cluster)
    }

    /// A folder and a port for a cluster, with no data folder yet.
    fn prepare() -> Result<Self, String> {
        let bin = bin_folder()?;
        let folder = std::env::temp_dir().join(format!("justonce-pg-{}", crate::unique()));
        std::fs::create_dir_all(&folder).map_err(|e| format!("{}: {e}", folder.display()))?;
        let root = std::fs::metadata("/proc/self").is_ok_and(|me| me.uid() == 0);
        let run_as = root.then_some("postgres");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .map_err(|e| format!("no free port: {e}"))?
            .port();
        let cluster = Self {
            folder,
            port,
            bin,
            run_as,
        };
        if let Some(user) = run_as {
            run(Command::new("chown").arg(user).arg(&cluster.folder))?;
        }
        Ok(cluster)
    }

    /// Creates and starts a streaming standby of this cluster on a port of its own, a copy
    /// taken with `pg_basebackup -R`. When `synchronous`, this cluster then waits for the
    /// standby to hold each commit before answering it (`synchronous_standby_names`).
    pub fn start_standby(&self, synchronous: bool) -> Result<Self, String> {
        let standby = Self::prepare()?;
        standby.copy_of(self)?;
        standby.start_again()?;
        if synchronous {
            append(
                &self.folder.join("data/postgresql.conf"),
                "synchronous_standby_names = '*'\n",
            )?;
            self.pg("pg_ctl", &["-D", &self.data(), "reload"])?;
            let given_up = Instant::now() + Duration::from_secs(30);
            while self.query("SELECT string_agg(sync_state, ',') FROM pg_stat_replication")?
                != "sync"
            {
                if Instant::now() >= given_up {
                    return Err("the standby did not become synchronous in time".to_owned());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(standby)
    }

    /// Brings this stopped server back as a streaming standby of `primary`, from a fresh
    /// copy of it on its own port: an old primary returning after a failover.
    pub fn rejoin_as_standby_of(&self, primary: &Self) -> Result<(), String> {
        let data = self.data();
        std::fs::remove_dir_all(&data).map_err(|e| format!("{data}: {e}"))?;
        self.copy_of(primary)?;
        self.start_again()
    }

    /// Fills this cluster's empty data folder with a copy of `primary` that streams from
    /// it once started (`pg_basebackup -R`).
    fn copy_of(&self, primary: &Self) -> Result<(), String> {
        let port = primary.port.to_string();
        self.pg(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-D",
                &self.data(),
                "-R",
                "-X",
                "stream",
                "--no-sync",
            ],
        )
    }

    /// Kills the server and its backends with SIGKILL, as a machine that dies would.
    pub fn kill(&self) -> Result<(), String> {
        let pid_file = self.folder.join("data/postmaster.pid");
        let postmaster = std::fs::read_to_string(&pid_file)
            .map_err(|e| format!("{}: {e}", pid_file.display()))?;
        let postmaster = postmaster.lines().next().unwrap_or_default().to_owned();
        let mut pids = vec![postmaster.clone()];
        for entry in std::fs::read_dir("/proc").map_err(|e| e.to_string())? {
            let Some(pid) = entry
                .ok()
                .and_then(|e| e.file_name().to_str()?.parse::<u32>().ok())
            else {
                continue;
            };
            if crate::process_status(pid).is_some_and(|status| status.get(1) == Some(&postmaster)) {
                pids.push(pid.to_string());
            }
        }
        run(Command::new("kill").arg("-KILL").args(&pids))?;
        let given_up = Instant::now() + Duration::from_secs(10);
        while pids
            .iter()
            .any(|pid| Path::new(&format!("/proc/{pid}")).exists())
        {
            if Instant::now() >= given_up {
                return Err(format!(
                    "the killed server's processes {pids:?} did not end"
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// Promotes a standby to a primary, and waits until it accepts writes.
    pub fn promote(&self) -> Result<(), String> {
        self.pg("pg_ctl", &["-D", &self.data(), "-w", "promote"])
    }

    /// The answer of one query, through `psql` on the server's socket, as unaligned text.
    pub fn query(&self, sql: &str) -> Result<String, String> {
        let socket = self.folder.display().to_string();
        let port = self.port.to_string();
        let output = self.pg_output(
            "psql",
            &["-h", &socket, "-p", &port, "-U", "postgres", "-tAc", sql],
        )?;
        Ok(output.trim().to_owned())
    }

    /// The cluster's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of the cluster's `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server at once, as a crash would: no shutdown checkpoint, clients cut.
    pub fn stop_immediately(&self) -> Result<(), String> {
        self.pg(
            "pg_ctl",
            &["-D", &self.data(), "-m", "immediate", "-w", "stop"],
        )
    }

    /// Starts the server, recovering from its WAL, and waits until it takes connections.
    pub fn start_again(&self) -> Result<(), String> {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1",
            self.port,
            self.folder.display()
        );
        let log = self.folder.join("log").display().to_string();
        self.pg(
            "pg_ctl",
            &[
                "-D",
                &self.data(),
                "-l",
                &log,
                "-o",
                &options,
                "-w",
                "start",
            ],
        )
    }

    fn data(&self) -> String {
        self.folder.join("data").display().to_string()
    }

    fn pg(&self, program: &str, args: &[&str]) -> Result<(), String> {
        self.pg_output(program, args).map(drop)
    }

    /// Runs one of PostgreSQL's programs as the server's user; returns what it printed.
    fn pg_output(&self, program: &str, args: &[&str]) -> Result<String, String> {
        let program = self.bin.join(program);
        let mut command = match self.run_as {
            Some(user) => {
                let mut command = Command::new("runuser");
                command.args(["-u", user, "--"]).arg(program);
                command
            }
            None => Command::new(program),
        };
        run_output(command.args(args).current_dir(&self.folder))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.stop_immediately();
        let _ = std::fs::remove_dir_all(&self.folder);
    }
}

/// PostgreSQL's programs: where `pg_config` says, or the newest of the Debian layout.
fn bin_folder() -> Result<PathBuf, String> {
    if let Ok(output) = Command::new("pg_config").arg("--bindir").output() {
        let bin = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
        if bin.join("initdb").exists() {
            return Ok(bin);
        }
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|_| "PostgreSQL's programs not found: no pg_config".to_owned())?
        .filter_map(|entry| Some(entry.ok()?.path().join("bin")))
        .filter(|bin| bin.join("initdb").exists())
        .collect();
    found.sort_by_key(|bin| version(bin));
    found
        .pop()
        .ok_or_else(|| "PostgreSQL's initdb not found".to_owned())
}

fn version(bin: &Path) -> u32 {
    bin.parent()
        .and_then(|folder| folder.file_name()?.to_str()?.parse().ok())
        .unwrap_or(0)
}

fn append(file: &Path, text: &str) -> Result<(), String> {
    std::fs::OpenOptions::new()
        .append(true)
        .open(file)
        .and_then(|mut file| file.write_all(text.as_bytes()))
        .map_err(|e| format!("{}: {e}", file.display()))
}

pub(crate) fn run(command: &mut Command) -> Result<(), String> {
    run_output(command).map(drop)
}

/// Runs `command`; returns its standard output, or its standard error if it failed.
fn run_output(command: &mut Command) -> Result<String, String> {
    let output = command.output().map_err(|e| format!("{command:?}: {e}"))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "{command:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}
