//! The launcher's environment, as torchrun (and `rlhf train --nproc`) set it: `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, and `TORCHELASTIC_USE_AGENT_STORE`
//! (the elastic agent already hosts the TCPStore, so every rank connects as a client); and a free
//! port for `MASTER_PORT` where the launcher picks one ([`free_port`]).

use crate::error::{CollectiveError, Result};

/// Where this process sits in a multi-process run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// The TCPStore is hosted by torchrun's agent, not by rank 0.
    pub agent_store: bool,
}

impl Launch {
    /// Reads the process environment. `Ok(None)`: no launcher (or `WORLD_SIZE=1`), one process.
    pub fn from_env() -> Result<Option<Launch>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// As [`Launch::from_env`], over any variable source (for tests).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>> {
        let number = |key: &str| -> Result<Option<usize>> {
            match var(key) {
                None => Ok(None),
                Some(v) => v
                    .trim()
                    .parse::<usize>()
                    .map(Some)
                    .map_err(|_| CollectiveError::Env(format!("{key}={v:?} is not a non-negative integer"))),
            }
        };
        let (rank, size) = (number("RANK")?, number("WORLD_SIZE")?);
        let size = match (rank, size) {
            (None, None) => return Ok(None),
            (Some(r), None) => {
                return Err(CollectiveError::Env(format!(
                    "RANK={r} is set but WORLD_SIZE is not (launch with torchrun or `rlhf train --nproc N`)"
                )))
            }
            (None, Some(s)) => {
                return Err(CollectiveError::Env(format!(
                    "WORLD_SIZE={s} is set but RANK is not (launch with torchrun or `rlhf train --nproc N`)"
                )))
            }
            (Some(_), Some(0)) => {
                return Err(CollectiveError::Env("WORLD_SIZE=0: a world needs at least one rank".into()))
            }
            (Some(_), Some(s)) => s,
        };
        let rank = rank.unwrap_or(0);
        if rank >= size {
            return Err(CollectiveError::Env(format!("RANK={rank} is not below WORLD_SIZE={size}")));
        }
        if size == 1 {
            return Ok(None);
        }
        let master_addr = var("MASTER_ADDR")
            .filter(|a| !a.trim().is_empty())
            .ok_or_else(|| CollectiveError::Env(format!("WORLD_SIZE={size} but MASTER_ADDR is not set")))?;
        let port = var("MASTER_PORT")
            .ok_or_else(|| CollectiveError::Env(format!("WORLD_SIZE={size} but MASTER_PORT is not set")))?;
        let master_port = port
            .trim()
            .parse::<u16>()
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| CollectiveError::Env(format!("MASTER_PORT={port:?} is not a port number (1-65535)")))?;
        let local_rank = number("LOCAL_RANK")?.unwrap_or(rank);
        let agent_store = var("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true"));
        Ok(Some(Launch {
            rank,
            world_size: size,
            local_rank,
            master_addr: master_addr.trim().to_string(),
            master_port,
            agent_store,
        }))
    }
}

/// A port nobody listens on now; rank 0 binds it moments later. It is taken below the OS's
/// ephemeral range (`ip_local_port_range`): the OS hands ports from that range to every outgoing
/// connection and every listener that asks for port 0 — gloo's among them — so a port picked from
/// it can go to another process between this check and rank 0's bind. The OS's own pick where that
/// range is unknown or leaves too little room below it.
pub fn free_port() -> std::io::Result<u16> {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let seed = u64::from(std::process::id())
        ^ std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let below = ephemeral_floor(&range).map(|low| candidate_ports(low, seed)).unwrap_or_default();
    for port in below {
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            return Ok(l.local_addr()?.port());
        }
    }
    Ok(std::net::TcpListener::bind(("127.0.0.1", 0))?.local_addr()?.port())
}

/// The first port of the OS's ephemeral range, from `ip_local_port_range` ("32768\t60999").
fn ephemeral_floor(range: &str) -> Option<u16> {
    range.split_whitespace().next()?.parse().ok()
}

/// Up to 64 distinct ports from `[20000, low)` (below the ephemeral range starting at `low`),
/// from a point `seed` draws on; none where that span is under 1000 ports.
fn candidate_ports(low: u16, seed: u64) -> Vec<u16> {
    const FLOOR: u16 = 20000;
    if low < FLOOR + 1000 {
        return Vec::new();
    }
    let span = u64::from(low - FLOOR);
    // A prime stride spreads the tries over the span (distinct unless the span is a multiple of it).
    (0..64u64).map(|i| FLOOR + ((seed.wrapping_add(i * 7919)) % span) as u16).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn launch(vars: &[(&str, &str)]) -> Result<Option<Launch>> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Launch::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn no_launcher_and_world_of_one_are_single_process() {
        assert_eq!(launch(&[]).unwrap(), None);
        assert_eq!(launch(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap(), None);
    }

    #[test]
    fn torchrun_variables_are_read() {
        let l = launch(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.2"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((l.rank, l.world_size, l.local_rank, l.master_port, l.agent_store), (3, 4, 1, 29500, true));
        assert_eq!(l.master_addr, "10.0.0.2");
    }

    #[test]
    fn inconsistent_environments_are_one_line_errors() {
        let msg = |v: &[(&str, &str)]| launch(v).unwrap_err().to_string();
        assert!(msg(&[("WORLD_SIZE", "2")]).contains("RANK is not"), "{}", msg(&[("WORLD_SIZE", "2")]));
        assert!(msg(&[("RANK", "1")]).contains("WORLD_SIZE is not"));
        assert!(msg(&[("RANK", "2"), ("WORLD_SIZE", "2")]).contains("RANK=2 is not below WORLD_SIZE=2"));
        assert!(msg(&[("RANK", "x"), ("WORLD_SIZE", "2")]).contains("RANK=\"x\""));
        assert!(msg(&[("RANK", "0"), ("WORLD_SIZE", "2")]).contains("MASTER_ADDR"));
        let bad_port = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "70000")];
        assert!(msg(&bad_port).contains("MASTER_PORT=\"70000\""));
    }

    /// The rendezvous port comes from below the ephemeral range: Linux's default range starts at
    /// 32768, so every try lies in [20000, 32768), all different; a range starting under 21000
    /// leaves the OS's pick; and the port found is free to bind.
    #[test]
    fn the_rendezvous_port_is_below_the_ephemeral_range() {
        assert_eq!(ephemeral_floor("32768\t60999\n"), Some(32768));
        assert_eq!(ephemeral_floor(""), None);
        for seed in [0, 1, u64::MAX, 123_456_789] {
            let ports = candidate_ports(32768, seed);
            assert_eq!(ports.len(), 64);
            assert!(ports.iter().all(|&p| (20000..32768).contains(&p)), "{ports:?}");
            let distinct: std::collections::HashSet<u16> = ports.iter().copied().collect();
            assert_eq!(distinct.len(), 64);
        }
        assert!(candidate_ports(20500, 7).is_empty());
        let port = free_port().unwrap();
        std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    }
}
