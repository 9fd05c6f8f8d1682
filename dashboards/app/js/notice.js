// A message for the next page shown (e.g. "job submitted" on the jobs page).
let pending = null;

export function flash(message) {
  pending = message;
}

export function takeNotice() {
  const message = pending;
  pending = null;
  return message;
}
