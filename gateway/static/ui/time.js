// Short labels for when something happened, in the browser's language and time zone: "now",
// "5 min. ago", "3 hr. ago", "yesterday", "3 days ago", then the date ("Mar 5"; "Mar 5, 2024" when
// it is not this year).

const MINUTE = 60_000;
const HOUR = 60 * MINUTE;
const DAY = 24 * HOUR;

/** The short label of an RFC 3339 time (a time in the future counts as now); "" if unparseable. */
export function ago(iso, now = Date.now()) {
  const t = Date.parse(iso);
  if (Number.isNaN(t)) return "";
  const age = Math.max(0, now - t);
  const rtf = new Intl.RelativeTimeFormat(undefined, { numeric: "auto", style: "short" });
  if (age < MINUTE) return rtf.format(0, "second");
  if (age < HOUR) return rtf.format(-Math.floor(age / MINUTE), "minute");
  if (age < DAY) return rtf.format(-Math.floor(age / HOUR), "hour");
  const days = Math.round((startOfDay(now) - startOfDay(t)) / DAY); // calendar days (DST-proof)
  if (days < 7) return rtf.format(-days, "day");
  const sameYear = new Date(t).getFullYear() === new Date(now).getFullYear();
  const date = sameYear ? { month: "short", day: "numeric" } : { year: "numeric", month: "short", day: "numeric" };
  return new Date(t).toLocaleDateString(undefined, date);
}

/** The full local date and time, e.g. for a tooltip; "" if unparseable. */
export function fullDate(iso) {
  const t = Date.parse(iso);
  return Number.isNaN(t) ? "" : new Date(t).toLocaleString(undefined, { dateStyle: "medium", timeStyle: "short" });
}

function startOfDay(ms) {
  const d = new Date(ms);
  return new Date(d.getFullYear(), d.getMonth(), d.getDate()).getTime();
}
