//! Bad usage: the error that makes `justonce` and its bench exit with code 2.

use std::fmt;

/// Bad usage or configuration found once the command runs, such as a malformed key or a
/// database URL of no kind justonce knows: exit code 2, where any other failure is 1.
#[derive(Debug)]
pub struct Usage(pub String);

impl fmt::Display for Usage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}
