//! A folder of its own to run `justonce` in, with only the variables a test gives it.

use crate::serve::without_inherited_settings;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::Command;

/// An empty folder of its own to run `justonce` in, as a new user does.
pub(crate) struct Folder {
    pub(crate) dir: PathBuf,
}

/// How one run of `justonce` ended.
pub(crate) struct Ran {
    pub(crate) code: i32,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
    pub(crate) took: Duration,
}

impl Folder {
    pub(crate) fn new(test: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("justonce-{test}-{}", justonce_tests::unique()));
        std::fs::create_dir_all(&dir).unwrap();
        Self { dir }
    }

    /// `justonce` with `args`, in the folder, with only the variables `vars`.
    pub(crate) fn command(&self, vars: &[(&str, &str)], args: &[&str]) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_justonce"));
        without_inherited_settings(&mut command);
        command
            .current_dir(&self.dir)
            .args(args)
            .env("RUST_LOG", "warn")
            .envs(vars.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        command
    }

    /// Runs `justonce` with `args` in the folder, with only the variables `vars`.
    pub(crate) async fn run(&self, vars: &[(&str, &str)], args: &[&str]) -> Ran {
        let output = self.command(vars, args).output();
        let started = Instant::now();
        let output = tokio::time::timeout(Duration::from_secs(60), output)
            .await
            .unwrap_or_else(|_| panic!("justonce {args:?} did not exit"))
            .unwrap();
        Ran {
            code: output.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
            took: started.elapsed(),
        }
    }

    /// The names of what the folder holds.
    pub(crate) fn entries(&self) -> Vec<String> {
        std::fs::read_dir(&self.dir)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    }

    /// The path of `name` in the folder, as text.
    pub(crate) fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }
}

impl Drop for Folder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
