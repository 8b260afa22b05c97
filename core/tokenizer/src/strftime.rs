//! A small `strftime` for the chat template's `strftime_now(fmt)` (used by Llama 3.x
//! templates for "Today Date: 26 Jul 2024"). Time is UTC: the crate has no time-zone
//! database, whereas transformers uses the process's local time.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

const DAYS: [&str; 7] = ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// A broken-down UTC time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DateTime {
    pub(crate) year: i64,
    /// 1..=12
    pub(crate) month: u32,
    /// 1..=31
    pub(crate) day: u32,
    pub(crate) hour: u32,
    pub(crate) minute: u32,
    pub(crate) second: u32,
    pub(crate) microsecond: u32,
    /// 0 = Sunday
    pub(crate) weekday: u32,
    /// 1..=366
    pub(crate) yearday: u32,
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

impl DateTime {
    /// Converts seconds (and microseconds) since the Unix epoch, UTC.
    pub(crate) fn from_unix(secs: i64, micros: u32) -> Self {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400);
        // Howard Hinnant's civil_from_days.
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = yoe + era * 400 + i64::from(month <= 2);
        const CUMULATIVE: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
        let leap_extra = u32::from(month > 2 && is_leap(year));
        let yearday = CUMULATIVE[(month - 1) as usize] + day + leap_extra;
        Self {
            year,
            month,
            day,
            hour: (rem / 3600) as u32,
            minute: (rem % 3600 / 60) as u32,
            second: (rem % 60) as u32,
            microsecond: micros,
            weekday: (days + 4).rem_euclid(7) as u32,
            yearday,
        }
    }

    /// The current UTC time.
    pub(crate) fn now_utc() -> Self {
        let (secs, micros) = match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => (i64::try_from(d.as_secs()).unwrap_or(i64::MAX / 2), d.subsec_micros()),
            Err(_) => (0, 0),
        };
        Self::from_unix(secs, micros)
    }
}

/// Formats like C/Python `strftime` in the C locale. Unknown directives are copied as-is
/// (glibc's behaviour); glibc's `%-d` style "no padding" flag is supported.
pub(crate) fn strftime(fmt: &str, t: &DateTime) -> String {
    let mut out = String::with_capacity(fmt.len() + 16);
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let Some(d) = chars.next() else {
            out.push('%');
            if no_pad {
                out.push('-');
            }
            break;
        };
        let num = |out: &mut String, v: i64, width: usize, pad: char| {
            if no_pad {
                let _ = write!(out, "{v}");
            } else if pad == ' ' {
                let _ = write!(out, "{v:>width$}");
            } else {
                let _ = write!(out, "{v:0width$}");
            }
        };
        let hour12 = match t.hour % 12 {
            0 => 12,
            h => h,
        };
        let weekday = DAYS[(t.weekday % 7) as usize];
        let month = MONTHS[((t.month + 11) % 12) as usize];
        match d {
            'a' => out.push_str(&weekday[..3]),
            'A' => out.push_str(weekday),
            'b' | 'h' => out.push_str(&month[..3]),
            'B' => out.push_str(month),
            'd' => num(&mut out, t.day.into(), 2, '0'),
            'e' => num(&mut out, t.day.into(), 2, ' '),
            'm' => num(&mut out, t.month.into(), 2, '0'),
            'Y' => {
                let _ = write!(out, "{}", t.year);
            }
            'y' => num(&mut out, t.year.rem_euclid(100), 2, '0'),
            'C' => num(&mut out, t.year.div_euclid(100), 2, '0'),
            'H' => num(&mut out, t.hour.into(), 2, '0'),
            'I' => num(&mut out, hour12.into(), 2, '0'),
            'M' => num(&mut out, t.minute.into(), 2, '0'),
            'S' => num(&mut out, t.second.into(), 2, '0'),
            'f' => num(&mut out, t.microsecond.into(), 6, '0'),
            'j' => num(&mut out, t.yearday.into(), 3, '0'),
            'p' => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            'u' => num(&mut out, (if t.weekday == 0 { 7 } else { t.weekday }).into(), 1, '0'),
            'w' => num(&mut out, t.weekday.into(), 1, '0'),
            'Z' => out.push_str("UTC"),
            'z' => out.push_str("+0000"),
            'D' => out.push_str(&strftime("%m/%d/%y", t)),
            'F' => out.push_str(&strftime("%Y-%m-%d", t)),
            'T' => out.push_str(&strftime("%H:%M:%S", t)),
            'R' => out.push_str(&strftime("%H:%M", t)),
            'r' => out.push_str(&strftime("%I:%M:%S %p", t)),
            'c' => out.push_str(&strftime("%a %b %e %H:%M:%S %Y", t)),
            'x' => out.push_str(&strftime("%m/%d/%y", t)),
            'X' => out.push_str(&strftime("%H:%M:%S", t)),
            'n' => out.push('\n'),
            't' => out.push('\t'),
            '%' => out.push('%'),
            other => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        let t = DateTime::from_unix(0, 0);
        assert_eq!((t.year, t.month, t.day, t.weekday, t.yearday), (1970, 1, 1, 4, 1));
        // 2024-07-26 13:05:09 UTC, a Friday, day 208 of a leap year.
        let t = DateTime::from_unix(1_721_999_109, 42);
        assert_eq!((t.year, t.month, t.day), (2024, 7, 26));
        assert_eq!((t.hour, t.minute, t.second), (13, 5, 9));
        assert_eq!((t.weekday, t.yearday), (5, 208));
        // 2000-02-29 and 2100-03-01.
        let t = DateTime::from_unix(951_782_400, 0);
        assert_eq!((t.year, t.month, t.day, t.yearday), (2000, 2, 29, 60));
        let t = DateTime::from_unix(4_107_542_400, 0);
        assert_eq!((t.year, t.month, t.day, t.yearday), (2100, 3, 1, 60));
        let t = DateTime::from_unix(-1, 0);
        assert_eq!((t.year, t.month, t.day, t.hour), (1969, 12, 31, 23));
    }

    #[test]
    fn formats_like_python() {
        let t = DateTime::from_unix(1_721_999_109, 42);
        // Expected strings are Python's datetime(2024,7,26,13,5,9,42).strftime(...).
        assert_eq!(strftime("%d %b %Y", &t), "26 Jul 2024");
        assert_eq!(strftime("%A, %B %-d %Y", &t), "Friday, July 26 2024");
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S.%f", &t), "2024-07-26 13:05:09.000042");
        assert_eq!(strftime("%I%p %j %y %a %%", &t), "01PM 208 24 Fri %");
        assert_eq!(strftime("%c", &t), "Fri Jul 26 13:05:09 2024");
        assert_eq!(strftime("%Q %", &t), "%Q %");
        let t = DateTime::from_unix(0, 0);
        assert_eq!(strftime("%e|%-m|%I", &t), " 1|1|12");
    }
}
