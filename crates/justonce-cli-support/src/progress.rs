//! The progress of a long command, on standard error so that standard output keeps only
//! its result: one line rewritten in place on a terminal, plain lines at most once a second
//! otherwise, and the final state always.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// One long command's progress line.
pub struct Progress {
    terminal: bool,
    printed: Option<Instant>,
    /// The state last reported, and whether it has been printed.
    current: Option<(String, bool)>,
}

impl Default for Progress {
    fn default() -> Self {
        Self::new()
    }
}

impl Progress {
    /// Nothing reported yet; lines rewritten in place when standard error is a terminal.
    pub fn new() -> Self {
        Self {
            terminal: std::io::stderr().is_terminal(),
            printed: None,
            current: None,
        }
    }

    /// Reports `state`, printed now if the last print is old enough.
    pub fn update(&mut self, state: String) {
        let every = if self.terminal {
            Duration::from_millis(100)
        } else {
            Duration::from_secs(1)
        };
        let due = self.printed.is_none_or(|at| at.elapsed() >= every);
        self.current = Some((state, false));
        if due {
            self.print();
        }
    }

    /// Prints the last state if it was not, and ends its line.
    pub fn finish(&mut self) {
        if matches!(self.current, Some((_, false))) {
            self.print();
        }
        if self.terminal && self.current.is_some() {
            eprintln!();
        }
        self.current = None;
        self.printed = None;
    }

    fn print(&mut self) {
        let Some((state, printed)) = &mut self.current else {
            return;
        };
        let mut stderr = std::io::stderr().lock();
        // A failed write to standard error leaves nothing better to do.
        let _ = if self.terminal {
            write!(stderr, "\r\x1b[2K{state}").and_then(|()| stderr.flush())
        } else {
            writeln!(stderr, "{state}")
        };
        *printed = true;
        self.printed = Some(Instant::now());
    }
}
