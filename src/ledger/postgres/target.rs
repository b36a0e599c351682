//! The servers a `ledger.url` lists, and which of them the node may write to: libpq's
//! multi-host form `postgres://user@host1:5433,host2:5434/db?target_session_attrs=read-write`,
//! which sqlx does not parse. Each listed server becomes a single-host URL of its own (user,
//! database and every other parameter shared) that sqlx does parse.
//!
//! `target_session_attrs` takes libpq's values that make sense for a ledger the node writes:
//! `any` (the default: the server, as it answers), `read-write` (one whose sessions are not
//! read-only, as libpq checks it: `SHOW transaction_read_only`) and `primary` (one not in
//! recovery). Several hosts need `read-write` or `primary`: with `any` a node could pick a
//! standby. The read-only ones (`read-only`, `standby`, `prefer-standby`) are refused at
//! start-up: a node must write. So are `host`, `hostaddr` and `port` parameters beside several
//! listed hosts (libpq's other multi-host spelling), which would override them.

use std::str::FromStr;

use sqlx::postgres::PgConnectOptions;

/// What makes a listed server the one to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// The first that answers (libpq's default).
    Any,
    /// One whose sessions may write: `transaction_read_only` is off.
    ReadWrite,
    /// One that is not a standby: `pg_is_in_recovery()` is false.
    Primary,
}

/// One listed server.
#[derive(Debug, Clone)]
pub struct Server {
    /// `host:port`, as the metrics and `/health/ready` name it.
    pub label: String,
    pub options: PgConnectOptions,
}

/// The servers of a `ledger.url`, in the order listed (the order they are tried in).
#[derive(Debug, Clone)]
pub struct Targets {
    pub servers: Vec<Server>,
    pub want: Want,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TargetError {
    #[error("ledger url has no scheme (postgres://…)")]
    NoScheme,
    #[error("ledger url lists an empty host")]
    EmptyHost,
    #[error("target_session_attrs={0} is not supported: a node must write (use any, read-write or primary)")]
    Unsupported(String),
    #[error("ledger url lists several hosts: set target_session_attrs=read-write (or primary), or a node could write to a standby")]
    SeveralWithoutAttrs,
    #[error("ledger url lists several hosts and a {0} parameter: list each as host:port instead")]
    Conflicting(String),
    #[error("ledger url for {host}: {reason}")]
    Invalid { host: String, reason: String },
}

impl Targets {
    pub fn parse(url: &str) -> Result<Targets, TargetError> {
        let (scheme, rest) = url.split_once("://").ok_or(TargetError::NoScheme)?;
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (user, hosts) = match authority.rsplit_once('@') {
            Some((user, hosts)) => (format!("{user}@"), hosts),
            None => (String::new(), authority),
        };
        let (path, query) = match tail.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (tail, None),
        };
        let mut want = Want::Any;
        let mut kept = Vec::new();
        for pair in query.into_iter().flat_map(|q| q.split('&')) {
            match pair.split_once('=') {
                Some(("target_session_attrs", value)) => {
                    want = match value {
                        "any" => Want::Any,
                        "read-write" => Want::ReadWrite,
                        "primary" => Want::Primary,
                        other => return Err(TargetError::Unsupported(other.to_string())),
                    }
                }
                _ if !pair.is_empty() => kept.push(pair),
                _ => {}
            }
        }
        let tail = if kept.is_empty() {
            path.to_string()
        } else {
            format!("{path}?{}", kept.join("&"))
        };
        // No host at all (`postgres:///db?host=/run/postgresql`, a Unix socket): one server.
        let hosts: Vec<&str> = if hosts.is_empty() {
            vec![""]
        } else {
            hosts.split(',').collect()
        };
        if hosts.len() > 1 {
            if hosts.contains(&"") {
                return Err(TargetError::EmptyHost);
            }
            if want == Want::Any {
                return Err(TargetError::SeveralWithoutAttrs);
            }
            if let Some(key) = kept.iter().find_map(|pair| {
                let key = pair.split('=').next().unwrap_or(pair);
                ["host", "hostaddr", "port"].contains(&key).then_some(key)
            }) {
                return Err(TargetError::Conflicting(key.to_string()));
            }
        }
        let servers = hosts
            .into_iter()
            .map(|host| {
                let one = format!("{scheme}://{user}{host}{tail}");
                let options =
                    PgConnectOptions::from_str(&one).map_err(|e| TargetError::Invalid {
                        host: host.to_string(),
                        reason: e.to_string(),
                    })?;
                let label = format!("{}:{}", options.get_host(), options.get_port());
                Ok(Server { label, options })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Targets { servers, want })
    }

    /// Is there anything to choose between? One server that any session will do needs no
    /// search: the pool reconnects to it by itself.
    pub fn needs_search(&self) -> bool {
        self.servers.len() > 1 || self.want != Want::Any
    }

    /// Every server's connection options changed by `f` (the session settings of the node).
    pub fn map_options(mut self, f: impl Fn(PgConnectOptions) -> PgConnectOptions) -> Self {
        for s in &mut self.servers {
            s.options = f(s.options.clone());
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_single_host_url_is_one_server_wanting_any() {
        let t = Targets::parse("postgres://postgres@127.0.0.1:5432/test").unwrap();
        assert_eq!(t.servers.len(), 1);
        assert_eq!(t.servers[0].label, "127.0.0.1:5432");
        assert_eq!(t.servers[0].options.get_database(), Some("test"));
        assert_eq!(t.want, Want::Any);
        assert!(!t.needs_search());
    }

    #[test]
    fn the_multi_host_form_lists_each_server_with_the_shared_rest() {
        let t = Targets::parse(
            "postgres://app:secret@10.0.0.1:5433,10.0.0.2,db3:6000/sales?target_session_attrs=read-write&application_name=node",
        )
        .unwrap();
        let labels: Vec<_> = t.servers.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(labels, ["10.0.0.1:5433", "10.0.0.2:5432", "db3:6000"]);
        for s in &t.servers {
            assert_eq!(s.options.get_database(), Some("sales"));
            assert_eq!(s.options.get_username(), "app");
            assert_eq!(s.options.get_application_name(), Some("node"));
        }
        assert_eq!(t.want, Want::ReadWrite);
        assert!(t.needs_search());
    }

    #[test]
    fn one_host_that_must_be_writable_is_still_checked() {
        let t = Targets::parse("postgres://h/db?target_session_attrs=primary").unwrap();
        assert_eq!(t.want, Want::Primary);
        assert!(t.needs_search());
        assert_eq!(t.servers[0].label, "h:5432");
    }

    #[test]
    fn a_url_without_a_host_is_one_server_as_before() {
        let t = Targets::parse("postgres:///db?host=/run/postgresql").unwrap();
        assert_eq!(t.servers.len(), 1);
        assert_eq!(t.servers[0].options.get_database(), Some("db"));
        assert!(!t.needs_search());
    }

    #[test]
    fn read_only_targets_and_empty_hosts_are_refused() {
        for attrs in ["read-only", "standby", "prefer-standby", "bogus"] {
            let url = format!("postgres://a,b/db?target_session_attrs={attrs}");
            assert_eq!(
                Targets::parse(&url).unwrap_err(),
                TargetError::Unsupported(attrs.to_string())
            );
        }
        assert_eq!(
            Targets::parse("postgres://a,b/db").unwrap_err(),
            TargetError::SeveralWithoutAttrs
        );
        assert_eq!(
            Targets::parse("postgres://a,b/db?target_session_attrs=primary&port=5433").unwrap_err(),
            TargetError::Conflicting("port".into())
        );
        for url in [
            "postgres://a,,b/db?target_session_attrs=primary",
            "postgres://a,/db?target_session_attrs=primary",
            "postgres://,a/db?target_session_attrs=primary",
        ] {
            assert_eq!(
                Targets::parse(url).unwrap_err(),
                TargetError::EmptyHost,
                "{url}"
            );
        }
        assert_eq!(
            Targets::parse("127.0.0.1:5432").unwrap_err(),
            TargetError::NoScheme
        );
        assert!(matches!(
            Targets::parse("postgres://a:notaport,b/db?target_session_attrs=primary").unwrap_err(),
            TargetError::Invalid { .. }
        ));
    }
}
