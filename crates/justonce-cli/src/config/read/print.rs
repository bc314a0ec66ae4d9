//! `justonce config`: the effective configuration as TOML, each value with where it came
//! from.

use super::document::value_at;
use super::origin::Origin;
use super::raw::{RawServer, keys_of, named_sections};
use super::toml_text::{bare_or_quoted, toml_value};
use toml::Spanned;
use toml::de::DeValue;

impl Origin<'_> {
    /// The effective configuration as TOML: each setting that has a value, with where it
    /// came from as a comment. Secrets appear as their `env:` references, which validation
    /// requires, and a password in a URL as `***`.
    pub fn print(&self) -> String {
        let mut printed = format!(
            "# The configuration justonce runs with: {}, JUSTONCE_* variables and defaults.\n",
            self.named_file()
        );
        self.print_table(&mut printed, &["server"], keys_of::<RawServer>());
        for (section, keys) in named_sections() {
            let Some(DeValue::Table(entries)) = self.document.get(section).map(Spanned::get_ref)
            else {
                continue;
            };
            for name in entries.keys() {
                self.print_table(&mut printed, &[section, name.get_ref()], keys);
            }
        }
        printed
    }

    fn print_table(&self, printed: &mut String, table: &[&str], keys: &[&str]) {
        let header: Vec<String> = table.iter().map(|part| bare_or_quoted(part)).collect();
        printed.push_str(&format!("\n[{}]\n", header.join(".")));
        for key in keys {
            let path: Vec<String> = table.iter().chain([key]).map(|p| (*p).to_owned()).collect();
            let (value, origin) = match value_at(&self.document, &path) {
                Some(value) => {
                    let origin = match self.overrides.get(&path) {
                        Some(variable) => format!("from {variable}"),
                        None => format!("{}, line {}", self.file, self.line(value.span().start)),
                    };
                    (toml_value(value.get_ref()), origin)
                }
                None => match self.defaults.borrow().get(&path) {
                    Some(default) => (default.clone(), "default".to_owned()),
                    None => continue,
                },
            };
            printed.push_str(&format!("{key} = {value}  # {origin}\n"));
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::load;
    use crate::config::testing::{env_of, load_text, shop_and_orders, write_temporary};

    #[test]
    fn the_printed_configuration_shows_each_origin_and_no_secret() {
        let env = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("ORDERS_BROKER", "amqp://guest:hunter2@127.0.0.1:5672/%2f"),
            (
                "DATABASE_URL",
                "postgres://app:hunter2@db.internal/app?sslmode=require&password=hunter2",
            ),
            ("JUSTONCE_SERVER_ADMIN_LISTEN", "127.0.0.1:19090"),
            ("JUSTONCE_SOURCES_SHOP_RETENTION", "10d"),
            (
                "JUSTONCE_CONSUMERS_AUDIT_FROM",
                "redis://:hunter2@127.0.0.1:6379",
            ),
            ("JUSTONCE_CONSUMERS_AUDIT_STREAM", "audit"),
            (
                "JUSTONCE_CONSUMERS_AUDIT_TARGET",
                "https://user:hunter2@example.com/a",
            ),
        ]);
        let path = write_temporary(&shop_and_orders());
        let file = path.display().to_string();
        let printed = load(&path, None, &env).unwrap().printed;
        let _ = std::fs::remove_file(&path);
        let expected = [
            "[server]".to_owned(),
            format!("listen = \"127.0.0.1:8080\"  # {file}, line 3"),
            "admin_listen = \"127.0.0.1:19090\"  # from JUSTONCE_SERVER_ADMIN_LISTEN".to_owned(),
            "database = \"postgres://app:***@db.internal/app?sslmode=require&password=***\"  \
             # from DATABASE_URL"
                .to_owned(),
            format!("body_limit = \"64KiB\"  # {file}, line 4"),
            "max_connections = 4096  # default".to_owned(),
            "header_timeout = \"10s\"  # default".to_owned(),
            "[sources.shop]".to_owned(),
            format!("secrets = [\"env:SHOP_SECRET\"]  # {file}, line 8"),
            "tolerance = \"5m\"  # default".to_owned(),
            "retention = \"10d\"  # from JUSTONCE_SOURCES_SHOP_RETENTION".to_owned(),
            "id = \"header:webhook-id\"  # default".to_owned(),
            "timeout = \"10s\"  # default".to_owned(),
            "[consumers.audit]".to_owned(),
            "from = \"redis://:***@127.0.0.1:6379\"  # from JUSTONCE_CONSUMERS_AUDIT_FROM"
                .to_owned(),
            "group = \"audit\"  # default".to_owned(),
            "target = \"https://user:***@example.com/a\"  # from JUSTONCE_CONSUMERS_AUDIT_TARGET"
                .to_owned(),
            "[consumers.orders]".to_owned(),
            format!("from = \"env:ORDERS_BROKER\"  # {file}, line 12"),
            format!("max_attempts = 3  # {file}, line 15"),
            "id = \"header:X-Order-Id\"".to_owned(),
        ];
        for line in &expected {
            assert!(
                printed.lines().any(|l| l.starts_with(line.as_str())),
                "{line:?} not in\n{printed}"
            );
        }
        for secret in ["c2VjcmV0", "hunter2"] {
            assert!(
                !printed.contains(secret),
                "a secret was printed:\n{printed}"
            );
        }
        // Keys that do not apply to a consumer's broker are not shown.
        let orders = printed.split("[consumers.orders]").nth(1).unwrap();
        assert!(
            !orders.contains("group =") && !orders.contains("stream ="),
            "{orders}"
        );

        // What is printed is a configuration the service takes, and prints the same.
        let secrets_only = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("ORDERS_BROKER", "amqp://127.0.0.1:5672/%2f"),
        ]);
        let again = load_text(&printed, &secrets_only).unwrap().printed;
        let values = |printed: &str| -> Vec<String> {
            printed
                .lines()
                .filter(|line| !line.starts_with('#'))
                .map(|line| line.split("  # ").next().unwrap().to_owned())
                .collect()
        };
        assert_eq!(values(&printed), values(&again));
    }
}
