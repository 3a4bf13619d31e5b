//! The jobs page's filters ([`JobFilter`]) and the checks of every page's
//! query parameters.

use std::collections::HashMap;

use leasehold_core::JobRecord;

use crate::feed::TERMINAL;
use crate::render::{self, url};

use super::ACTIVE;

/// The jobs page's filters, checked.
#[derive(Debug, Clone, Default)]
pub struct JobFilter {
    pub kind: Option<String>,
    pub status: Option<String>,
    pub tenant: Option<String>,
    pub prefix: Option<String>,
    pub limit: usize,
    pub offset: usize,
}

/// A number parameter, or a sentence saying what is wrong with it.
pub fn number(q: &HashMap<String, String>, key: &str, default: usize) -> Result<usize, String> {
    match q.get(key).map(|s| s.trim()).filter(|s| !s.is_empty()) {
        None => Ok(default),
        Some(v) => v
            .parse()
            .map_err(|_| format!("{key}={v:?} is not a whole number")),
    }
}

/// The page size asked for, refused over the largest page.
pub fn limit(
    q: &HashMap<String, String>,
    page_max: usize,
    default: usize,
) -> Result<usize, String> {
    let n = number(q, "limit", default)?;
    if n == 0 || n > page_max {
        return Err(format!(
            "limit={n} is outside 1..={page_max} (the largest page, --page-max)"
        ));
    }
    Ok(n)
}

/// Checks the keys of `q` against `allowed`.
pub fn only(q: &HashMap<String, String>, allowed: &[&str]) -> Result<(), String> {
    for k in q.keys() {
        if !allowed.contains(&k.as_str()) {
            return Err(format!(
                "unknown parameter {k:?}; this page takes {}",
                allowed.join(", ")
            ));
        }
    }
    Ok(())
}

impl JobFilter {
    pub fn parse(q: &HashMap<String, String>, page_max: usize) -> Result<JobFilter, String> {
        only(
            q,
            &["kind", "status", "tenant", "prefix", "limit", "offset"],
        )?;
        let get = |k: &str| {
            q.get(k)
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        };
        let status = get("status");
        if let Some(s) = &status {
            if !ACTIVE.contains(&s.as_str()) && !TERMINAL.contains(&s.as_str()) {
                return Err(format!(
                    "status={s:?} is not a status; use one of {}, {}",
                    ACTIVE.join(", "),
                    TERMINAL.join(", ")
                ));
            }
        }
        for (k, v) in [
            ("kind", get("kind")),
            ("prefix", get("prefix")),
            ("tenant", get("tenant")),
        ] {
            if v.as_ref()
                .is_some_and(|v| v.len() > 256 || v.chars().any(char::is_control))
            {
                return Err(format!(
                    "{k} is not a plausible value (at most 256 printable characters)"
                ));
            }
        }
        Ok(JobFilter {
            kind: get("kind"),
            status,
            tenant: get("tenant"),
            prefix: get("prefix"),
            limit: limit(q, page_max, 50)?,
            offset: number(q, "offset", 0)?,
        })
    }

    pub(super) fn query(&self) -> String {
        let mut parts = Vec::new();
        for (k, v) in [
            ("kind", &self.kind),
            ("status", &self.status),
            ("tenant", &self.tenant),
            ("prefix", &self.prefix),
        ] {
            if let Some(v) = v {
                parts.push(format!("{k}={}", url(v)));
            }
        }
        parts.join("&")
    }

    /// Whether a record passes kind, prefix and tenant (not status).
    pub fn admits(&self, r: &JobRecord) -> bool {
        self.kind.as_ref().is_none_or(|k| *k == r.kind)
            && self
                .prefix
                .as_ref()
                .is_none_or(|p| r.id.starts_with(p.as_str()))
            && self
                .tenant
                .as_ref()
                .is_none_or(|t| render::tenant(r).as_deref() == Some(t.as_str()))
    }
}
