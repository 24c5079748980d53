//! `strftime_now(format)`, the global transformers gives chat templates (Llama
//! 3.x puts today's date in its system prompt). Time is UTC; the common
//! directives are supported and unknown ones are kept verbatim.

use std::time::{SystemTime, UNIX_EPOCH};

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
const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// Broken-down UTC time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DateTime {
    pub year: i64,
    /// 1..=12
    pub month: u32,
    /// 1..=31
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
    /// 0 = Monday.
    pub weekday: u32,
    /// 1..=366
    pub yday: u32,
}

impl DateTime {
    pub fn from_unix(secs: i64) -> DateTime {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400) as u32;
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
        let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
        let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
        let yday = cumulative[(month - 1) as usize] + day + u32::from(leap && month > 2);
        // 1970-01-01 was a Thursday (3 with Monday = 0).
        let weekday = (days + 3).rem_euclid(7) as u32;
        DateTime { year, month, day, hour: rem / 3600, minute: rem / 60 % 60, second: rem % 60, weekday, yday }
    }

    pub fn now() -> DateTime {
        let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
        DateTime::from_unix(secs)
    }

    pub fn format(&self, fmt: &str) -> String {
        let mut out = String::new();
        let mut chars = fmt.chars();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let month = MONTHS[(self.month - 1) as usize];
            let day = DAYS[self.weekday as usize];
            match chars.next() {
                Some('d') => out.push_str(&format!("{:02}", self.day)),
                Some('m') => out.push_str(&format!("{:02}", self.month)),
                Some('Y') => out.push_str(&self.year.to_string()),
                Some('y') => out.push_str(&format!("{:02}", self.year.rem_euclid(100))),
                Some('b') => out.push_str(&month[..3]),
                Some('B') => out.push_str(month),
                Some('a') => out.push_str(&day[..3]),
                Some('A') => out.push_str(day),
                Some('H') => out.push_str(&format!("{:02}", self.hour)),
                Some('I') => out.push_str(&format!("{:02}", (self.hour + 11) % 12 + 1)),
                Some('p') => out.push_str(if self.hour < 12 { "AM" } else { "PM" }),
                Some('M') => out.push_str(&format!("{:02}", self.minute)),
                Some('S') => out.push_str(&format!("{:02}", self.second)),
                Some('j') => out.push_str(&format!("{:03}", self.yday)),
                Some('w') => out.push_str(&((self.weekday + 1) % 7).to_string()),
                Some('F') => out.push_str(&format!("{}-{:02}-{:02}", self.year, self.month, self.day)),
                Some('%') => out.push('%'),
                Some(other) => {
                    out.push('%');
                    out.push(other);
                }
                None => out.push('%'),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_known_dates() {
        let t = DateTime::from_unix(1_721_952_000); // 2024-07-26 00:00:00 UTC, a Friday
        assert_eq!(t.format("%d %b %Y"), "26 Jul 2024");
        assert_eq!(t.format("%A %B %j %F %H:%M:%S %%"), "Friday July 208 2024-07-26 00:00:00 %");
        let t = DateTime::from_unix(951_782_400); // 2000-02-29
        assert_eq!(t.format("%Y-%m-%d %a %j"), "2000-02-29 Tue 060");
        assert_eq!(DateTime::from_unix(0).format("%F %a"), "1970-01-01 Thu");
    }
}
